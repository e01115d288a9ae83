"""The ``serve`` section: ``rltrain serve``, the Tinker API in front of the learners and engines."""

from __future__ import annotations

from pydantic import Field

from rltrain.config.optimization import Section


class ServeConfig(Section):
    host: str = "127.0.0.1"
    """Address the server listens on (the loopback by default: no other machine reaches it)."""
    port: int = Field(8000, ge=0, le=65535)
    """Port it listens on; 0 picks a free one (the line the server prints at start names it)."""
    base_models: list[str] = Field(default_factory=lambda: ["builtin:tiny"], min_length=1)
    """The base models a client may ask for (the `base_model` the SDK sends): `builtin:*` names or
    local folders."""
    max_models: int = Field(4, ge=1)
    """Models trained at once (each with its own adapters, AdamW moments and order of calls; on
    learners they share, `serve.models_per_learners`), by any clients and on any served base model.
    A `create_model` past it, or whose learners the cluster's free CPUs (or GPUs) cannot hold
    beside the live models' and the engines', is refused in one line saying so; a session that
    ends (or stops heartbeating) releases its models."""
    models_per_learners: int = Field(8, ge=1)
    """Models that share one set of learners (`learner.num_learners` of them), as Tinker serves
    many LoRA models on one base: models of the same base model, adapters (rank, modules) and seed
    take seats on the same learners, which hold one model's state at a time (its adapters, AdamW's
    moments and step, the gradient its calls added since its last step) and set the others' aside,
    so each model trains exactly as it would alone. A model past it, or unlike the live ones, gets
    learners of its own. 1: every model its own learners."""
    max_request_mib: float = Field(256.0, gt=0)
    """The largest request body taken (the SDK sends a `forward_backward` of many datums in chunks);
    a larger one is refused (HTTP 413) before the rest of it is read."""
    poll_s: float = Field(20.0, gt=0)
    """How long a `retrieve_future` poll is held before it answers "try again" (the SDK polls
    again at once)."""
    session_timeout_s: float = Field(120.0, gt=0)
    """A session whose heartbeats (the SDK sends one every 10 s) stopped this long ago ends: its
    model is released (its saved states stay) and its sampling sessions are closed, within a
    second or two of the timeout."""
    order_timeout_s: float = Field(60.0, gt=0)
    """How long a model's call waits for a call with a lower `seq_id` that has not arrived (the
    SDK uploads a call's chunks in parallel, its first chunk last); past it the waiting calls fail
    in one sentence and the model goes on with later ones. Calls never run out of order."""
    result_ttl_s: float = Field(600.0, gt=0)
    """How long a result nobody retrieved is kept (a retrieved one is freed a minute after, for a
    poll the SDK repeats)."""
    kept_learners: int = Field(2, ge=0)
    """Learner groups of released models (their sessions ended) kept started, for the next model
    placed alike: restarted in their processes on its base, adapters and seed (a fresh start, bit
    for bit) in a fraction of a second instead of new processes' start; the oldest stopped past it,
    and any whose CPUs (or GPUs) a new model's learners need. 0: stopped at release."""
    kept_snapshots: int = Field(16, ge=1)
    """Unnamed sampler weights (`save_weights_and_get_sampling_client`) kept in memory for the
    sampling clients made on them; an older client's request is refused in one sentence (named
    sampler weights reload from disk)."""
    snapshot_mib: float = Field(2048.0, gt=0)
    """The bytes those snapshots may take in Ray's object store, all models together: past it the
    oldest are let go (the newest always stays), as past `kept_snapshots`."""
    merged_exports: bool = True
    """Named sampler weights also as the merged model (a folder transformers loads), beside the
    peft adapter."""
