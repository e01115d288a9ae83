"""Prefix-tree forwards (rltrain.learner.prefix_tree): a micro-batch's shared prompts computed once.
Log-probs, entropies, values and every parameter's gradient equal the unshared forward's to fp32
rounding; the attention reads the tree from the position ids alone; the planner keeps a group's
tree whole within the token budget; the load-balancing loss counts a shared token once per member;
learner.prefix_sharing's auto shares where it pays and turns itself off where the forward differs."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config, Qwen3MoeConfig

from rltrain.batch import TrainBatch
from rltrain.config import Config, load_config
from rltrain.forward import attention, sequence_logprobs, token_outputs
from rltrain.forward.attention import document_attention
from rltrain.forward.tree import build_tree, tree_logprobs, tree_outputs
from rltrain.learner.prefix_tree import PrefixSharing
from rltrain.loss.moe import expert_counts, load_balancing_loss, router_entropy_sum
from rltrain.models.routers import RouterTap
from rltrain.plan import plan_packed_micro_batches, shared_prefix_lengths

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
VOCAB = 97


def tiny(cls=AutoModelForCausalLM, config=None, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    config = config or Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, **kwargs)  # fmt: skip
    return cls.from_config(config, attn_implementation=attention.register()).float().eval()


def rows(prompts: list[list[int]], completions: list[list[int]]) -> TrainBatch:
    """Left-padded prompts, right-padded completions (the collate layout); response = completion."""
    p, c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(prompts), p + c, dtype=torch.long)
    mask, response = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        ids[i, p : p + len(completion)] = torch.tensor(completion, dtype=torch.long)
        mask[i, p - len(prompt) : p + len(completion)] = 1
        response[i, p : p + len(completion)] = 1
    return TrainBatch(ids, mask, response, torch.ones_like(ids), torch.zeros(len(prompts)))


def mixed_batch() -> TrainBatch:
    """Two groups (prompts of 9 and 6 tokens) with a duplicate completion; a multi-turn group whose
    members share a prompt and, two of them, an environment's opening turn too (a tree that
    branches twice: its shareable lead is longer than its prompt); a row sharing nothing; an
    empty row."""
    g = torch.Generator().manual_seed(1)

    def draw(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    p1, p2, p3, turn = draw(9), draw(6), draw(5), draw(4)
    c = [draw(n) for n in (6, 3, 4, 5, 1, 7, 2, 3, 5)]
    prompts = [p1, p1, p1, p1, p2, p2, p3 + turn, p3 + turn, p3, draw(4), [1]]
    completions = [c[0], c[1], c[2], c[2], c[3], c[4], c[5], c[6], c[7], c[8], [1]]
    batch = rows(prompts, completions)
    batch.attention_mask[-1] = 0  # an empty row (a padded micro-batch's filler)
    batch.response_mask[-1] = 0
    return batch


def shared_and_unshared(model, batch: TrainBatch, temperature: float = 1.0):
    tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool())
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(2))
    out = []
    for shared in (True, False):
        model.zero_grad()
        if shared:
            logprobs, entropy = tree_logprobs(model, tree, batch.input_ids, temperature, True)
        else:
            logprobs, entropy = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature, True,
                                                  packed=True)  # fmt: skip
        (logprobs * weights * batch.attention_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((logprobs.detach(), entropy, grads))
    return tree, out


def test_tree_logprobs_entropies_and_gradients_equal_the_unshared_forward():
    model = tiny()
    batch = mixed_batch()
    tree, ((logprobs, entropy, grads), (want, want_entropy, want_grads)) = shared_and_unshared(
        model, batch, 0.7
    )
    # unshared packed: 4 x 9 + (6+3+4+4) + 2 x 6 + (5+1) + 9 + 7 + 9 + 2 + 5 + 4 + 3 + 5 + 1 + 1 tokens;
    # the tree runs each group's prompt once and the multi-turn group's shared turn once
    assert tree.unshared_tokens == int(batch.attention_mask.sum())
    assert tree.tokens == tree.unshared_tokens - 3 * 9 - 6 - (9 + 5)  # 3 prompt copies, 1, and 9 + 5 saved
    torch.testing.assert_close(logprobs, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    assert torch.isfinite(logprobs).all() and (logprobs[-1] == 0).all()  # the empty row: 0, no NaN
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():  # a shared token's gradient: the sum over its copies
        assert (grad - want_grads[name]).norm() <= 1e-5 * want_grads[name].norm(), name


def test_each_member_keeps_the_positions_of_its_own_row():
    batch = mixed_batch()
    tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool())
    positions, ids = tree.position_ids_1L[0], tree.input_ids_1L[0]
    for b in range(len(batch)):
        keep = batch.attention_mask[b].bool()
        cells = tree.cell_BT[b][keep]
        # every token at its own position (RoPE continues from the prompt's end) and id
        assert positions[cells].tolist() == list(range(int(keep.sum())))
        assert ids[cells].tolist() == batch.input_ids[b][keep].tolist()
    # the first group's 4 members share one copy of their 9 prompt tokens
    assert (tree.cell_BT[:4, 0:9] == tree.cell_BT[0, 0:9]).all() and tree.uses_L[tree.cell_BT[0, 0]] == 4
    # no completion token is shared, even the duplicate completion's (rows 2 and 3)
    completion = batch.response_mask.bool()
    assert (tree.uses_L[tree.cell_BT[completion]] == 1).all()


def test_tree_attention_is_each_branch_over_its_ancestors():
    # a root of 3 tokens, a branch continuing it (2), a sibling branch at position 3 (2 tokens), a
    # branch at position 1 (1 token: its ancestor is token 0 only), then a document of 2
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 10, 4), torch.randn(1, 1, 10, 4), torch.randn(1, 1, 10, 4)
    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 1, 0, 1]])
    sees = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 3, 4], 5: [0, 1, 2, 5],
            6: [0, 1, 2, 5, 6], 7: [0, 7], 8: [8], 9: [8, 9]}  # fmt: skip
    allowed = torch.zeros(10, 10, dtype=torch.bool)
    for i, js in sees.items():
        allowed[i, js] = True
    expected = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), attn_mask=allowed)
    torch.testing.assert_close(document_attention(q, k, v, positions), expected)


def test_values_through_the_tree_equal_the_unshared_forward():
    model = tiny(AutoModelForTokenClassification, num_labels=1)
    batch = mixed_batch()
    tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool())
    with torch.no_grad():
        shared = tree_outputs(model, tree)
        unshared = token_outputs(model, batch.input_ids, batch.attention_mask, packed=True)
    torch.testing.assert_close(shared, unshared, rtol=0, atol=1e-5)


def test_a_padded_batch_on_the_tree_attention_runs_as_on_sdpa():
    # a model loaded for trees still runs left-padded rows under their mask (transformers' sdpa)
    model = tiny()
    sdpa = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa").float()
    sdpa.load_state_dict(model.state_dict())
    batch = mixed_batch()
    with torch.no_grad():
        ours, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
        theirs, _ = sequence_logprobs(sdpa, batch.input_ids, batch.attention_mask)
    keep = batch.attention_mask.bool()
    torch.testing.assert_close(ours[keep], theirs[keep], rtol=0, atol=1e-6)


def test_the_load_balancing_loss_counts_a_shared_token_once_per_member():
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                            num_experts_per_tok=2, decoder_sparse_step=1)  # fmt: skip
    model = tiny(config=config)
    tap = RouterTap(model)
    batch = mixed_batch()
    tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool())
    uses = torch.bincount(tree.cell_BT[batch.attention_mask.bool()], minlength=tree.tokens)
    from rltrain.forward import pack_sequences, packed_forward

    results = []
    for shared in (True, False):
        model.zero_grad()
        with tap.capture() as (routed, chosen):
            if shared:
                tree_logprobs(model, tree, batch.input_ids)
                rows = uses
            else:
                packed_forward(model, *pack_sequences(batch.input_ids, batch.attention_mask))
                rows = torch.ones(int(batch.attention_mask.sum()), dtype=torch.bool)
        counts = expert_counts(routed, rows, 2, chosen)
        loss = load_balancing_loss(routed, rows, counts, 2)
        loss.backward()
        grads = [p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
        results.append((counts, loss.detach(), router_entropy_sum(routed, rows), grads))
    (counts, loss, entropy, grads), (want_counts, want_loss, want_entropy, want_grads) = results
    assert torch.equal(counts, want_counts)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-6, atol=0)
    for grad, want in zip(grads, want_grads):
        assert (grad - want).norm() <= 1e-5 * want.norm()


def test_replayed_routes_and_their_mismatches_count_a_shared_token_once_per_member():
    # routing replay's counts (moe/routes_replayed, moe/routing_mismatch): through the tree a shared
    # prompt token's row is replayed once, and counts once per member, as in the packed forward.
    # The engine's routes are another model's (its routers nudged), so some rows go elsewhere
    import copy

    from rltrain.batch import ROUTE_UNKNOWN
    from rltrain.learner.route_rows import in_forward_order, router_rows

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                            num_experts_per_tok=2, decoder_sparse_step=1)  # fmt: skip
    engine = tiny(config=config)
    learner = copy.deepcopy(engine)
    with torch.no_grad():
        for name, param in learner.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    batch = mixed_batch()
    with torch.no_grad(), RouterTap(engine).capture() as (_, chosen):
        sequence_logprobs(engine, batch.input_ids, batch.attention_mask)
    n, t = batch.input_ids.shape
    routes = torch.stack(chosen, 1).reshape(n, t, len(chosen), -1)
    routes[~batch.attention_mask.bool()] = ROUTE_UNKNOWN
    batch = batch.replace(routes=routes)
    tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool())
    tap, counts = RouterTap(learner), []
    for shared in (True, False):
        tap.routes = in_forward_order(
            routes, batch.attention_mask, True, 1, 0, ROUTE_UNKNOWN, tree if shared else None
        )
        tap.row_weights = router_rows(batch, True, 1, 0, tree) if shared else None
        with torch.no_grad(), tap.capture(measure=True):
            if shared:
                tree_logprobs(learner, tree, batch.input_ids)
            else:
                sequence_logprobs(learner, batch.input_ids, batch.attention_mask, packed=True)
        counts.append(tap.take_mismatch().tolist())
    (elsewhere, replayed), unshared = counts
    assert [elsewhere, replayed] == unshared and 0 < elsewhere < replayed
    assert replayed == batch.attention_mask.sum().item() * 2  # every attended token, both layers


def test_the_planner_keeps_a_groups_tree_whole_and_splits_one_over_the_budget():
    # 3 groups of 4 (prompt 10, completions 2-5 tokens) and 2 sequences sharing nothing
    prompts = [[g + 1] * 10 for g in range(3) for _ in range(4)] + [[50] * 10, [60] * 10]
    completions = [[70] * (2 + i % 4) for i in range(14)]
    batch = rows(prompts, completions)
    shared = shared_prefix_lengths(batch)
    assert shared == [0, 10, 10, 10] * 3 + [0, 0]
    lengths = batch.sequence_lengths()
    # a tree: 10 + (2 + 3 + 4 + 5) = 24 tokens, unshared 54; budget 24 holds one tree a micro-batch
    plan = plan_packed_micro_batches(lengths, 1, 1, 24, shared)
    micro = [m.tolist() for m in plan.groups[0][0]]
    for g in range(3):
        assert [4 * g, 4 * g + 1, 4 * g + 2, 4 * g + 3] in micro
    assert sorted(i for m in micro for i in m) == list(range(14))  # nothing dropped or repeated
    # budget 20: each tree splits into sub-trees of members 0-2 (10 + 2 + 3 + 4 = 19) and member 3
    # (its own copy of the prompt: 15)
    split = [m.tolist() for m in plan_packed_micro_batches(lengths, 1, 1, 20, shared).groups[0][0]]
    assert [0, 1, 2] in split and not any(3 in m and 0 in m for m in split)
    assert sorted(i for m in split for i in m) == list(range(14))
    # without sharing the same budget (24) fits fewer sequences per micro-batch
    assert len(plan_packed_micro_batches(lengths, 1, 1, 24).groups[0][0]) > len(micro)


def test_the_planner_spreads_a_tree_every_group_shares_over_the_ranks():
    # 4 groups of 4 whose prompts all open with the same 6-token system turn, then a 4-token
    # question: consecutive sequences share 10 tokens in a group and 6 across a group boundary, so
    # the whole batch chains into one tree (what left one learner idle in the demo)
    prompts = [[9] * 6 + [g + 1] * 4 for g in range(4) for _ in range(4)]
    completions = [[70] * 5 for _ in range(16)]
    batch = rows(prompts, completions)
    shared = shared_prefix_lengths(batch)
    assert shared == [0, 10, 10, 10] + [6, 10, 10, 10] * 3
    lengths = batch.sequence_lengths()  # 15 each
    # one tree: 6 + 4 * (4 + 4 * 5) = 102 tokens; the budget holds it all
    plan = plan_packed_micro_batches(lengths, 2, 1, 200, shared)
    shares = [sorted(i for m in plan.groups[rank][0] for i in m.tolist()) for rank in range(2)]
    # each rank two whole groups (cut at a group boundary, repeating only the system turn):
    # each half 6 + 2 * (4 + 4 * 5) = 54 tokens
    assert sorted(shares) == [list(range(8)), list(range(8, 16))]
    # one group alone over 2 ranks splits in the middle, each half with its own prompt copy
    alone = plan_packed_micro_batches(lengths[:4], 2, 1, 200, shared[:4])
    assert sorted(m.tolist() for rank in alone.groups for m in rank[0]) == [[0, 1], [2, 3]]
    # one rank: nothing to balance, the tree stays whole
    assert [m.tolist() for m in plan_packed_micro_batches(lengths, 1, 1, 200, shared).groups[0][0]] == [
        list(range(16))
    ]


def test_prefix_sharing_with_sequence_parallelism_is_refused_in_one_line():
    with pytest.raises(Exception) as error:
        load_config(
            "configs/cpu_demo.yaml", ["learner.prefix_sharing=true", "learner.sequence_parallel_size=2"]
        )
    assert "learner.prefix_sharing" in str(error.value) and "sequence_parallel_size=2" in str(error.value)
    config = load_config("configs/cpu_demo.yaml", ["learner.sequence_parallel_size=2"])
    assert config.learner.prefix_sharing == "auto"  # auto shares only without sequence parallelism


def model_forward(model_path: str, attn: str):
    """Per-token log-probs of a plain model (no learner), through the tree ``sharing`` picks."""
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation=attn).float().eval()

    def forward(sharing: PrefixSharing, batch: TrainBatch) -> torch.Tensor:
        tree = sharing.tree(batch)
        if tree is not None:
            return tree_logprobs(model, tree, batch.input_ids)[0]
        return sequence_logprobs(model, batch.input_ids, batch.attention_mask, packed=sharing.packed())[0]

    return forward


def test_auto_shares_where_it_saves_tokens_and_true_and_false_force_it():
    grouped = rows([[5] * 20] * 4, [[6], [7, 8], [9], [10, 11, 12]])  # 4 x 20 prompt tokens, 20 once
    distinct = rows([[5] * 20, [6] * 20], [[7], [8]])  # nothing in common
    auto, true, false = PrefixSharing("auto"), PrefixSharing(True), PrefixSharing(False)
    assert auto.tree(grouped) is None  # auto runs nothing shared before its check passed
    auto.on = True  # (as the check leaves it)
    assert auto.tree(grouped) is not None and auto.tree(distinct) is None
    assert true.tree(distinct) is not None and false.tree(grouped) is None
    # the metrics' counts: 4 x 20 + 7 tokens unshared (one packed row), 20 + 7 through the tree
    assert auto.tokens_forwarded(grouped, 4 * 20 + 7) == 20 + 7 and false.tokens_forwarded(grouped, 87) == 87
    assert auto.tree(grouped) is auto.tree(grouped)  # one tree per micro-batch within a call


def loss_tokens(batch: TrainBatch) -> torch.Tensor:
    return batch.response_mask.bool() & batch.tool_mask.bool()


def test_autos_check_turns_sharing_off_in_one_line_where_the_shared_forward_differs(tiny_model_path, capsys):
    batch = rows([[5, 9, 13] * 7] * 4, [[6, 1], [7, 8, 2], [9], [10, 11, 12]])
    # the tree attention: the check passes and sharing stays on; before it, nothing runs shared
    right, forward = PrefixSharing("auto"), model_forward(tiny_model_path, attention.register())
    assert right.tree(batch) is None and not right.checked
    assert right.check({"policy": lambda mb: forward(right, mb)}, [batch], loss_tokens, False, 0) is True
    assert right.setting == "auto" and right.checked and right.tree(batch) is not None
    assert capsys.readouterr().out == ""
    # sdpa reads the tree row as one causal sequence: completions see their siblings
    wrong, forward = PrefixSharing("auto"), model_forward(tiny_model_path, "sdpa")
    assert wrong.check({"policy": lambda mb: forward(wrong, mb)}, [batch], loss_tokens, False, 0) is False
    assert wrong.on is False and wrong.tree(batch) is None
    out = capsys.readouterr().out.strip()
    assert "learner.prefix_sharing: auto" in out and "policy by" in out and "going on unshared" in out
    assert "\n" not in out


def test_autos_check_compares_every_model_on_a_micro_batch_with_loss_tokens_and_fails_on_nan(
    tiny_model_path, capsys
):
    grouped = rows([[5, 9, 13] * 7] * 4, [[6, 1], [7, 8, 2], [9], [10, 11, 12]])
    unmasked = grouped.replace(response_mask=torch.zeros_like(grouped.response_mask))  # no loss token
    forward = model_forward(tiny_model_path, attention.register())

    def check(policy_shift: float = 0.0, reference_shift: float = 0.0, batches=(grouped,)) -> PrefixSharing:
        # a shift is what the shared forward adds to a model's outputs (NaN: a forward gone wrong)
        sharing = PrefixSharing("auto")

        def shifted(shift):
            return lambda mb: forward(sharing, mb) + (shift if sharing.tree(mb) is not None else 0.0)

        forwards = {"policy": shifted(policy_shift), "reference": shifted(reference_shift)}
        sharing.check(forwards, list(batches), loss_tokens, False, 0)
        return sharing

    assert check().on is True
    # the reference alone differs: sharing goes off for the group, the line names it
    assert check(reference_shift=0.1).on is False
    assert "reference by 0.1" in capsys.readouterr().out
    # NaN: `nan > tolerance` is false, and the check must still fail
    assert check(policy_shift=float("nan")).on is False
    assert "policy by inf" in capsys.readouterr().out
    # a first micro-batch without loss tokens is passed over: the next one is checked
    assert check(policy_shift=0.1, batches=(unmasked, grouped)).on is False
    # nothing with loss tokens to compare: undecided, and nothing runs shared meanwhile
    undecided = check(policy_shift=0.1, batches=(unmasked,))
    assert undecided.on is None and undecided.tree(grouped) is None


@pytest.mark.slow
def test_a_failed_check_before_the_first_reference_forward_plans_every_batch_unshared(
    ray_local, tiny_model_path, tmp_path
):
    # a model whose tree rows differ from its packed rows (remote code that reads position ids as
    # documents alone: its packed rows are right, as the check of packed rows against padded ones finds),
    # a reference beside the policy (loss.kl_beta), groups of 4 sharing their prompt. The first call
    # is the reference's log-probs before any update: auto's check runs there, on both models, turns
    # sharing off, and those log-probs are the unshared ones; the update after it is planned
    # unshared, within the budget of the unshared forward
    from model_utils import positionless_model

    from rltrain.diagnostics import layout_config, synthetic_rollouts
    from rltrain.learner.group import LearnerGroup

    path = positionless_model(tiny_model_path, tmp_path / "positionless")
    batch = synthetic_rollouts(group_size=4)
    budget = 24  # a group's tree fits (its prompt once: 10 + 2 + 2 + 8 tokens), its 31 tokens unshared do not
    raw = layout_config(1, 1, 0, max_tokens_per_micro_batch=budget, loss={"kl_beta": 0.1}).model_dump()
    raw["model"]["trust_remote_code"] = True
    group = LearnerGroup(Config.model_validate(raw), path, total_optimizer_steps=1)
    try:
        reference = group.per_token(batch)
        metrics = group.train_step(batch)
    finally:
        group.shutdown()
    lengths = batch.sequence_lengths()
    shared_plan = plan_packed_micro_batches(lengths, 1, 1, budget, shared_prefix_lengths(batch))
    unshared_plan = plan_packed_micro_batches(lengths, 1, 1, budget)
    assert unshared_plan.micro_batches_per_group() != shared_plan.micro_batches_per_group()
    # the reference's log-probs: each micro-batch of the unshared plan as one packed row
    model = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, attn_implementation=attention.register()
    )
    unshared = torch.zeros(batch.input_ids.shape)
    for idx in unshared_plan.groups[0][0]:
        mb = batch.select(idx)
        unshared[idx] = sequence_logprobs(model.eval(), mb.input_ids, mb.attention_mask, packed=True)[
            0
        ].detach()
    keep = batch.response_mask.bool()
    torch.testing.assert_close(reference[keep], unshared[keep], rtol=0, atol=1e-5)
    assert metrics["train/micro_batches"] == unshared_plan.micro_batches_per_group()[0]
    assert metrics["perf/tokens_forwarded"] == metrics["perf/forward_tokens"]  # nothing shared


@pytest.mark.slow
def test_packed_rows_that_differ_from_padded_ones_stop_the_run_in_one_line(
    ray_local, tiny_model_path, tmp_path
):
    # remote code that ignores position ids runs a packed row as one long sequence: its documents
    # attend to each other. learner.packing is checked against padded rows on the first micro-batch
    # that has loss tokens, and the run stops naming the layout and the setting that avoids it (before,
    # it trained on; only the engine-learner gap hinted at it)
    from model_utils import positionless_model

    from rltrain.diagnostics import layout_config, synthetic_rollouts
    from rltrain.learner.group import LearnerGroup
    from rltrain.learner.prefix_tree import LayoutMismatch

    path = positionless_model(tiny_model_path, tmp_path / "ignores", ignored=True)
    raw = layout_config(1, 1, 0, max_tokens_per_micro_batch=200, prefix_sharing=False).model_dump()
    raw["model"]["trust_remote_code"] = True
    group = LearnerGroup(Config.model_validate(raw), path, total_optimizer_steps=1)
    try:
        with pytest.raises(LayoutMismatch) as stopped:
            group.train_step(synthetic_rollouts(group_size=4))
    finally:
        group.shutdown()
    line = str(stopped.value)
    assert line.startswith(
        "learner.packing: packed rows give other outputs than padded rows (policy learner by"
    )
    assert "set learner.packing=false" in line and "\n" not in line

    # the Tinker server's learners check their first call alike, and refuse every later call of the
    # model in the same line (a forward of two datums: packed, the second attends to the first)
    from rltrain.learner.served import Datums, ServedGroup

    served = ServedGroup(Config.model_validate(raw), path)
    datums = Datums.of([[5, 6, 7, 8, 9], [10, 11, 12]], [[6, 7, 8, 9, 10], [11, 12, 13]],
                       [{"weights": [1.0] * 5}, {"weights": [1.0] * 3}])  # fmt: skip
    try:
        for _call in range(2):
            with pytest.raises(LayoutMismatch) as stopped:
                served.forward_backward(datums, "cross_entropy", {}, forward_only=True)
            line = str(stopped.value)
            assert line.startswith("learner.packing: packed rows give other outputs than padded rows (served "
                                   "learner by") and "set learner.packing=false" in line and "\n" not in line  # fmt: skip
    finally:
        served.shutdown()
