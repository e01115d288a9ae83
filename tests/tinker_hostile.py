"""Malformed and hostile requests to every route of `rltrain serve` that takes a body or an id,
sent raw (tests/test_tinker_server.py): bodies that are no JSON object, each field of each route
given a value of the wrong kind or out of range, ids that would become paths, and a body past the
server's limit. Every one must be refused with a 4xx and one sentence, before anything is queued."""

import json

# values each field is given in turn, none of them what the field takes
WRONG = [("a list", [1]), ("an object", {"a": 1}), ("a float", 1.5), ("true", True), ("-1", -1), ("text", "abc"),
         ("a traversal", "../../x"), ("huge", 10**40)]  # fmt: skip
NOT_AN_OBJECT = [("no JSON", b"{nope"), ("an array", b"[1, 2]"), ("a string", b'"x"'), ("null", b"null"),
                 ("empty", b""), ("a number", b"7"), ("binary", bytes(range(256))),
                 ("nested past the parser", b"[" * 100_000 + b"]" * 100_000), ("bad UTF-8", b'{"a": "\xff"}')]  # fmt: skip
ROUTES = ["session_heartbeat", "retrieve_future", "create_model", "get_info", "optim_step", "save_weights",
          "load_weights", "save_weights_for_sampler", "create_sampling_session", "asample"]  # fmt: skip


def hostile_requests(
    session: str, model: str, sampler: str, state: str, base: str
) -> list[tuple[str, str, str, dict]]:
    """(name, method, route, what httpx sends) of each request; ``session``, ``model``, ``sampler``
    and ``state`` (a saved state's ``tinker://`` path) are the caller's own, ``base`` a served
    base model, so that what is refused is the one field named."""
    out = []

    def add(name, route, body=None, method="POST", raw=None):
        out.append(
            (name, method, f"/api/v1/{route}", {"content": raw} if raw is not None else {"json": body})
        )

    for route in ROUTES + ["forward_backward"]:
        for name, raw in NOT_AN_OBJECT:
            add(f"{route}: {name}", route, raw=raw)
    add("forward_backward: no ForwardBackwardRequest", "forward_backward", raw=b"\x08\x96\x01" * 100)
    add(
        "forward_backward: a body past serve.max_request_mib (8 here)",
        "forward_backward",
        raw=b"\x00" * (9 << 20),
    )
    lora = {"rank": 2}
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}
    new_model = {"session_id": session, "base_model": base, "model_seq_id": 9, "lora_config": lora}
    step = {"model_id": model, "seq_id": 1000, "adam_params": {"learning_rate": 1e-3}}
    sample = {"sampling_session_id": sampler, "prompt": prompt}
    for name, value in WRONG:
        if name != "-1":
            for key in ("session_id", "base_model", "lora_config"):
                add(f"create_model {key}: {name}", "create_model", {**new_model, key: value})
            add(
                f"create_model optimizer_config: {name}",
                "create_model",
                {**new_model, "optimizer_config": [value]},
            )
            add(f"heartbeat session_id: {name}", "session_heartbeat", {"session_id": value})
            add(f"retrieve_future request_id: {name}", "retrieve_future", {"request_id": value})
            add(f"get_info model_id: {name}", "get_info", {"model_id": value})
            add(f"optim_step model_id: {name}", "optim_step", {**step, "model_id": value})
            add(f"optim_step adam_params: {name}", "optim_step", {**step, "adam_params": value})
            add(
                f"save_weights path: {name}",
                "save_weights",
                {"model_id": model, "seq_id": 1000, "path": value},
            )
            add(
                f"load_weights path: {name}",
                "load_weights",
                {"model_id": model, "seq_id": 1000, "path": value},
            )
            add(f"load_weights as a new model, path: {name}", "load_weights",
                {"session_id": session, "path": value, "model_seq_id": 9})  # fmt: skip
            add(f"create_sampling_session model_path: {name}", "create_sampling_session",
                {"session_id": session, "model_path": value})  # fmt: skip
            add(f"asample sampling_session_id: {name}", "asample", {**sample, "sampling_session_id": value})
            add(f"asample prompt: {name}", "asample", {**sample, "prompt": value})
            add(f"asample chunks: {name}", "asample", {**sample, "prompt": {"chunks": value}})
            if name not in ("a list", "an object"):  # (tokens [1]; settings the SDK may add are not read)
                add(f"asample tokens: {name}", "asample",
                    {**sample, "prompt": {"chunks": [{"type": "encoded_text", "tokens": value}]}})  # fmt: skip
                add(f"asample sampling_params: {name}", "asample", {**sample, "sampling_params": value})
            add(f"sampler: {name}", f"samplers/{json.dumps(value)}", method="GET")
            add(f"finish: {name}", f"sessions/{json.dumps(value)}/finish")
        add(f"create_model model_seq_id: {name}", "create_model", {**new_model, "model_seq_id": value})
        add(f"create_model rank: {name}", "create_model", {**new_model, "lora_config": {"rank": value}})
        add(
            f"create_model seed: {name}",
            "create_model",
            {**new_model, "lora_config": {**lora, "seed": value}},
        )
        add(f"optim_step seq_id: {name}", "optim_step", {**step, "seq_id": value})
        if name not in ("a float", "huge"):  # (a float is a learning rate; 1e40 is one too)
            add(
                f"optim_step learning_rate: {name}",
                "optim_step",
                {**step, "adam_params": {"learning_rate": value}},
            )
        add(f"save_weights overwrite: {name}", "save_weights",
            {"model_id": model, "seq_id": 1000, "path": "x", "overwrite": value if name != "true" else "yes"})  # fmt: skip
        add(f"load_weights model_seq_id: {name}", "load_weights",
            {"session_id": session, "path": state, "model_seq_id": value})  # fmt: skip
        add(f"asample num_samples: {name}", "asample", {**sample, "num_samples": value})
        for key in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop"):
            if (
                not (key == "temperature" and name in ("a float", "huge"))
                and not (key == "stop" and name in ("text", "a traversal", "a list"))
                and not (key == "top_k" and name == "-1")
            ):  # (a temperature of 1.5 or 1e40, a stop
                # string, a stop token 1, top_k -1 for none: what those take)
                add(f"asample {key}: {name}", "asample", {**sample, "sampling_params": {key: value}})
        add(f"asample prompt_logprobs_last_n: {name}", "asample",
            {**sample, "prompt_logprobs": True, "prompt_logprobs_last_n": value})  # fmt: skip
    add("checkpoints of a traversal", "training_runs/..%2F..%2Fx/checkpoints", method="GET")
    return out
