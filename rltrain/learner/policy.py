"""The policy's learner: per-token log-probs (padded, packed or sequence-parallel), the policy loss
(:func:`rltrain.loss.losses.policy_loss`), the frozen reference for a KL term, the rollout
correction's rejections, decided on the pre-update policy before the step's token totals, and a
mixture of experts' load-balancing loss (:mod:`rltrain.loss.moe`), its assignment counts taken on
the pre-update policy too and summed in the same collective, and its routing replay (every forward
sends each token to the experts the engine chose, :mod:`rltrain.models.routers`)."""

from __future__ import annotations

import contextlib

import torch

from rltrain import forward
from rltrain.batch import TrainBatch
from rltrain.config import Config
from rltrain.forward.layouts import trailing_order
from rltrain.forward.model import causal_lm
from rltrain.learner import sequence_parallel
from rltrain.learner.engine import EngineLearner
from rltrain.learner.route_rows import moe_metrics, replayed_routes, router_rows
from rltrain.loss.corrections import RolloutCorrection, correction_mask
from rltrain.loss.logprobs import Truncation
from rltrain.loss.losses import PolicyLossSettings, policy_loss
from rltrain.loss.moe import expert_counts, load_balancing_loss, router_entropy_sum
from rltrain.models import adapters
from rltrain.models.images import placeholder_ids
from rltrain.models.routers import RouterTap, aux_coef, replay_problem


def rollout_correction(config: Config) -> RolloutCorrection | None:
    """The correction the loss applies (``loss.rollout_correction``), or None."""
    c = config.loss.rollout_correction
    return None if c is None else RolloutCorrection(c.kind, c.level, c.cap, c.low, c.high)


class PolicyLearner(EngineLearner):
    """A policy rank: per-token log-probs (padded, packed or sequence-parallel), the policy loss,
    a frozen reference model for the KL term."""

    METRIC_SUMS = ["pg_loss", "kl", "clipped", "ratio", "entropy", "mismatch_kl", "mismatch_tokens", "rejected",
                   "dppo_masked_low", "dppo_masked_high", "tokens"]  # fmt: skip
    METRIC_MAXES = ["mismatch_max"]
    TEMPERATURE: float | None = None  # of the log-probs; None: rollout.temperature (the sampling one)

    def __init__(self, config: Config, model_path: str, rank: int, world_size: int):
        super().__init__(config, model_path, rank, world_size)
        loss = config.loss
        self.loss_settings = PolicyLossSettings(
            kind=loss.kind, clip_low=loss.clip_low, clip_high=loss.clip_high, dual_clip=loss.dual_clip,
            kl_beta=loss.kl_beta, kl_estimator=loss.kl_estimator, correction=rollout_correction(config),
            aggregation=loss.aggregation, aggregation_norm=config.aggregation_norm,
            dppo_divergence=loss.dppo_divergence, dppo_delta_low=loss.dppo_delta_low,
            dppo_delta_high=loss.dppo_delta_high, dppo_anchor=loss.dppo_anchor, dppo_ratio_cap=loss.dppo_ratio_cap,
        )  # fmt: skip
        self.ref_model = None
        self.tap: RouterTap | None = None  # a mixture of experts' routers
        self.ref_tap: RouterTap | None = None  # the frozen reference's, under routing replay
        self.replay = config.rollout.routing_replay
        self.moe_coef, self.moe_step = 0.0, False
        self._counts: list[torch.Tensor] = []  # each micro-batch's expert assignments before the step
        # the last forward's router logits, the rows that count and their expert assignments
        self._routed: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor] | None = None

    trains_adapters = True  # with model.lora.rank

    @property
    def has_reference(self) -> bool:
        return self.config.loss.kl_beta > 0 or self.config.algorithm.kl_in_reward > 0

    def _build_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if self.lora_rank:  # the reference is this model with its adapters off: no second copy
            model = self._load_model(AutoModelForCausalLM)
            with torch.random.fork_rng():  # the same adapters on every rank and in every layout
                torch.manual_seed(self.config.run.seed)
                model = adapters.wrap(model, self.config.model.lora)
        else:
            if self.has_reference:
                # the frozen reference lives beside the policy on every learner: its forward runs on
                # the rank's own shard only, so no extra actors and no transfer of log-probs are needed
                device = "cuda" if self.use_cuda else "cpu"
                self.ref_model = (
                    self._load_model(AutoModelForCausalLM).to(device).eval().requires_grad_(False)
                )
            model = self._load_model(AutoModelForCausalLM)
        self._watch_routers(model)
        return model

    def _watch_routers(self, model: torch.nn.Module) -> None:
        """A mixture of experts: hooks on its routers (and the frozen reference's, which replay
        the routes too), the load-balancing loss's weight and scope, and the router metrics
        (assignments per layer and expert, entropy, under replay the routes it changed). A router
        no kind reads keeps its model's metrics off; asked for the loss or replay, it stops the
        start in one line (preflight says so first)."""
        name = self.config.model.name_or_path
        if self.replay and (problem := replay_problem(model)):
            raise ValueError(f"rollout.routing_replay: {name}: {problem}")
        tap = RouterTap(model)
        coef = aux_coef(model, self.config.loss.moe_aux_coef) if tap.routers or tap.problem else 0.0
        if tap.problem and coef > 0:
            raise ValueError(f"loss.moe_aux_coef: {name}: {tap.problem}; set loss.moe_aux_coef=0")
        if not tap.routers:
            return
        self.tap = tap
        if self.replay and self.ref_model is not None:
            self.ref_tap = RouterTap(self.ref_model)
        self.moe_coef = coef
        self.moe_step = self.moe_coef > 0 and self.config.loss.moe_aux_scope == "step"
        experts = len(tap.routers) * tap.num_experts
        self.METRIC_TOTALS = {"moe_aux": 1, "router_entropy": 1, "router_rows": 1, "expert_load": experts}
        if self.replay:
            self.METRIC_TOTALS["routing_mismatch"] = 2  # (rows the router would send elsewhere, rows)

    def zero_gradient_proof(self) -> str | None:
        """See :func:`zero_gradient_proof` (the policy's)."""
        return zero_gradient_proof(self.config, self.lc, self.loss_settings, self.moe_coef)

    def _shared_forwards(self) -> dict:
        forwards = super()._shared_forwards()
        if self.ref_model is not None or (self.has_reference and self.lora_rank):
            forwards["reference"] = self._reference_logprobs
        return forwards

    def _rows(self, mb: TrainBatch) -> torch.Tensor:
        order = trailing_order(self.engine, mb.attention_mask)  # (a model's padding after each sequence)
        return router_rows(mb, self.sharing.packed(), self.sp, self.sp_rank, self.sharing.tree(mb), order)

    def _reference_logprobs(self, mb: TrainBatch) -> torch.Tensor:
        """The reference policy's log-probs: the frozen copy's, or with LoRA the policy's own with
        its adapters off."""
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, mb)[0]
        with self.engine.module.disable_adapter():
            return self._logprobs(self.engine, mb)[0]

    def _logprobs(self, model, mb: TrainBatch, with_entropy: bool = False, temperature: float | None = None):
        """Per-token log-probs ``[B, T]`` of a micro-batch: padded, packed, as a prefix tree
        (``learner.prefix_sharing``) or this rank's share of a sequence-parallel packed row. Without
        an explicit ``temperature``, of the distribution the engine sampled from
        (``rollout.temperature`` and its top_k/top_p/min_p)."""
        sampling = temperature is None and self.TEMPERATURE is None  # the engine's distribution
        temperature = temperature or self.TEMPERATURE or self.config.rollout.temperature
        rc = self.config.rollout
        # (a vision-language model's placeholders: never sampled, out of the engine's distribution)
        banned = placeholder_ids(causal_lm(model).config)
        truncation = Truncation(rc.top_k, rc.top_p, rc.min_p, banned) if sampling else None
        packed, tree = self.sharing.packed(), self.sharing.tree(mb)
        if self.replay and self.tap is not None:  # this forward's routes (kept for a recomputation)
            tap = self.ref_tap if model is self.ref_model else self.tap
            tap.routes = replayed_routes(
                mb, packed, self.sp, self.sp_rank, tree, trailing_order(self.engine, mb.attention_mask)
            )
            tap.row_weights = None if tree is None else self._rows(mb)  # a shared row: once per member
        return forward.logprobs(
            model, self._row(mb), temperature, with_entropy, truncation, agree_chunks=self.agree_chunks
        )

    def _per_token(self, mb: TrainBatch, own: bool = False) -> torch.Tensor:
        """The reference model's log-probs (for a KL penalty in the reward); ``own``: the policy's
        (at temperature 1, as an engine scores a prompt: the weight sync's check)."""
        if not self.has_reference and not own:
            raise RuntimeError(
                "no reference model on the learners (loss.kl_beta and algorithm.kl_in_reward are 0)"
            )
        if own:
            logprobs_BT = self._logprobs(self.engine, mb, temperature=1.0)[0]
        else:
            logprobs_BT = self._reference_logprobs(mb)
        # under sequence parallelism each rank holds the tokens it owns (0 elsewhere): the group's
        # sum is every token's log-prob, which the driver reads from the group's first rank
        return sequence_parallel.group_sum(logprobs_BT) if self.sp > 1 else logprobs_BT

    def _loss(self, mb: TrainBatch, denominator):
        with self._capture(measure=True) as (routed, chosen):
            logprobs, entropy = self._logprobs(self.engine, mb, with_entropy=True)
        old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
        loss, metrics = policy_loss(
            logprobs,
            old,
            mb.advantages,
            mb.response_mask,
            denominator,
            self.loss_settings,
            tool_mask_BT=mb.tool_mask,
            ref_logprobs_BT=mb.ref_logprobs,
            generator_logprobs_BT=mb.generator_logprobs,
            sequence_tokens_B=mb.sequence_tokens,
            # GSPO's sequence ratio sums each sequence's log-ratios over the ranks sharing its row
            sequence_sum=sequence_parallel.group_sum if self.sp > 1 else None,
            fresh_BT=mb.fresh_mask,
        )
        keep = mb.response_mask.bool() & mb.loss_tool_mask().bool()
        metrics["entropy"] = torch.where(keep, entropy, 0.0).sum()
        if self.tap is not None:
            rows = self._rows(mb)
            counts = expert_counts(routed, rows, self.tap.top_k, chosen)
            self._routed = routed, rows, counts
            metrics |= {"expert_load": counts, "router_entropy": router_entropy_sum(routed, rows),
                        "router_rows": rows.sum() * len(routed)}  # fmt: skip
            if self.replay:
                metrics["routing_mismatch"] = self.tap.take_mismatch()
        return loss, metrics

    def _capture(self, measure: bool = False):
        return contextlib.nullcontext(([], [])) if self.tap is None else self.tap.capture(measure)

    def _scaled_loss(self, accumulation_steps: int, metrics: dict[str, torch.Tensor]) -> torch.Tensor | float:
        """The load-balancing loss of the last forward: its share of the step's loss (the group's
        counts, :mod:`rltrain.loss.moe`; times the ranks the engine averages over), or with
        ``micro_batch`` scope its own loss over the accumulation steps."""
        routed, self._routed = self._routed, None
        if not self.moe_coef or routed is None:
            return 0.0
        (logits, rows, counts), k = routed, self.tap.top_k
        if self.moe_step:
            aux = load_balancing_loss(logits, rows, self.group_counts.view(len(logits), -1), k)
            metrics["moe_aux"] = aux.detach()  # summed over micro-batches and ranks: the step's loss
            return self.moe_coef * self.world_size * aux
        aux = load_balancing_loss(logits, rows, counts, k) / accumulation_steps  # its own counts
        metrics["moe_aux"] = aux.detach() / self.world_size  # summed: the mean over ranks
        return self.moe_coef * aux

    def _step_counts(self, flat: list[TrainBatch]) -> list[torch.Tensor] | None:
        return self._counts if self.moe_step else None

    def _finish_totals(self, totals: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        if self.tap is None:
            return {}
        aux_steps = optimizer_steps if self.moe_coef else None
        return moe_metrics(totals, len(self.tap.routers), aux_steps, self.replay)

    def _finish_metrics(self, out: dict[str, float]) -> dict[str, float]:
        out["train/clip_fraction"] = out.pop("train/clipped")
        for side in ("low", "high"):  # DPPO: the share of loss tokens masked on each side
            masked = out.pop(f"train/dppo_masked_{side}")
            if self.loss_settings.kind == "dppo":
                out[f"loss/dppo_masked_{side}"] = masked
        # the engine's sampling log-probs against the learner's under the same weights: a rollout
        # matter; a mean over the tokens measured (both sums came divided by the loss tokens)
        measured = out.pop("train/mismatch_tokens")
        out["rollout/mismatch_kl"] = out.pop("train/mismatch_kl") / measured if measured > 0 else 0.0
        out["rollout/mismatch_max"] = out.pop("train/mismatch_max")
        # the share of the loss tokens both figures cover: those the current weights sampled (none
        # where every rollout was generated ahead, under older weights)
        out["rollout/mismatch_measured"] = measured
        rejected = out.pop("train/rejected")  # per kept token: the share of all is r / (1 + r)
        if self.loss_settings.correction is not None and self.loss_settings.correction.rejects:
            out["rollout/correction_rejected"] = rejected / (1.0 + rejected)
        return out

    @torch.no_grad()
    def _before_training(self, groups: list[list[TrainBatch]]) -> list[list[TrainBatch]]:
        """Reference log-probs (KL) and, when the batch takes several optimizer steps, the
        pre-update policy's log-probs, so every step's ratio is against the same old policy."""
        lc, correction = self.lc, self.loss_settings.correction
        rejects = correction is not None and correction.rejects
        # a rejecting correction decides before the step's token totals, on the pre-update policy
        needs_old = lc.num_mini_batches > 1 or lc.ppo_epochs > 1 or rejects
        out, self._counts = [], []
        for group in groups:
            new_group = []
            for mb in group:
                changes = {}
                if self.has_reference:
                    changes["ref_logprobs"] = self._reference_logprobs(mb)
                if needs_old or self.moe_step:
                    # the load-balancing loss's assignment counts: the pre-update routes
                    with self._capture() as (routed, chosen):
                        old, _ = self._logprobs(self.engine, mb)
                    if needs_old:
                        changes["old_logprobs"] = old
                    if self.moe_step:  # (the replayed routes where replay is on)
                        counts = expert_counts(routed, self._rows(mb), self.tap.top_k, chosen)
                        self._counts.append(counts.reshape(-1))
                mb = mb.replace(**changes)
                if rejects and mb.generator_logprobs is not None:
                    mb = reject(mb, correction, self.sp, self.sp_rank)
                new_group.append(mb)
            out.append(new_group)
        return out


def reject(mb: TrainBatch, correction: RolloutCorrection, sp: int, sp_rank: int) -> TrainBatch:
    """Fold the correction's rejections into ``correction_mask`` (the step's token totals honour
    it). Under sequence parallelism (``sp`` ranks a row, this one ``sp_rank``) a rank decides on the
    tokens it owns, sequence ratios are summed over its group, and each sequence's token count and
    counting rank are redone."""
    keep = mb.response_mask.bool() & mb.tool_mask.bool()
    sequence_sum = sequence_parallel.group_sum if sp > 1 else None
    accept = correction_mask(mb.old_logprobs, mb.generator_logprobs, keep, correction, sequence_sum)
    mb = mb.replace(correction_mask=accept.to(mb.tool_mask.dtype))
    if sp == 1:
        return mb
    kept = accept.any(-1).float()  # [B]: whether this rank still holds a loss token of the sequence
    ranks = torch.zeros(len(mb), sp, device=kept.device)
    ranks[:, sp_rank] = kept
    ranks = sequence_sum(ranks)  # [B, sp]: which ranks hold one; the lowest holds the first token
    first = torch.where(ranks.any(-1), (ranks > 0).float().argmax(-1), -1)
    counted = (first == sp_rank).long()
    return mb.replace(sequence_tokens=sequence_sum(accept.sum(-1).float()).long(), counted=counted)


def zero_gradient_proof(config: Config, lc, settings: PolicyLossSettings, moe_coef: float) -> str | None:
    """None where the policy loss is ``A`` times a function of the log-probs and nothing else of the
    step reads a sequence of advantage 0 (``learner.skip_zero_gradient``): every surrogate here
    (PPO's clipped ratio, GSPO's, CISPO's, DPPO's) is zero with its gradient at ``A = 0``; else the
    term that reads it, in words."""
    loss, alg, correction = config.loss, config.algorithm, settings.correction
    reasons = [
        (not lc.skip_zero_gradient, "learner.skip_zero_gradient=false"),
        (loss.masked_mean_denominator is None, "per-micro-batch means (a micro-batch's denominator is what it holds)"),
        (loss.kl_beta > 0, "loss.kl_beta > 0 (the KL to the reference moves weights at any advantage)"),
        (moe_coef > 0, "the load-balancing loss (its routers' rows in every sequence)"),
        (alg.advantage in ("gae", "distill"), f"algorithm.advantage={alg.advantage} (a critic's or a teacher's per-token advantages)"),
        (correction is not None and correction.rejects, "a rejecting rollout correction (it decides on every token before the totals)"),
    ]  # fmt: skip
    return next((why for holds, why in reasons if holds), None)
