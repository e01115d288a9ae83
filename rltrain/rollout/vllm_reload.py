"""New weights into a running vLLM engine, in place, including what vLLM 0.32's reload leaves out.

vLLM's ``reload_weights`` (``is_checkpoint_format=True``: Hugging Face names) moves each layer's
parameters to the meta device, buffers what the layer's weight loaders receive and, once every
element has arrived, processes the layer and copies it back into the kernel's tensors. Two things
it does not finish, both fixed here after it:

- **Parameters a model's loader writes itself**, without their weight loader (gpt-oss's experts
  and attention sinks: ``param.copy_``): the writes land in the meta copy, vLLM puts the old
  tensors back ("Failed to load weights") and the engine samples from the old experts and sinks.
  Such a layer's tensors are loaded again through the model's own loader straight into the kernel's
  tensors (:func:`reload`), its names mapped as the loader maps them.
- **The CPU experts' blocked layout**: vLLM's CPU experts re-lay their weights into the kernel's
  layout once, after the first load; a reload writes the checkpoint layout back and skips that
  step, so a mixture of experts would run on scrambled weights (log-probs off by ~0.03 with the
  weights unchanged). It is redone on every layer whose experts run that kernel.

The run's first sync after an update checks the engine's log-probs against the learners'
(``run.check_sync``), so a reload that leaves anything else out stops the run in one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


class Reloader:
    """Loads new weights into one engine (see the module docstring). Which tensors the reload leaves
    out is a property of the model: the first reload keeps every tensor until it knows (references
    to the arriving buffers, no copies), later ones only those."""

    def __init__(self, llm):
        self.llm = llm
        self.left_out: set[str] | None = None  # checkpoint names the reload leaves out (None: not known yet)
        # the engine's parameters the last reload wrote nothing into, as vLLM's own loaders
        # accounted for them (None: no reload yet)
        self.unloaded: list[str] | None = None

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``named_tensors`` (Hugging Face names, read as they arrive)."""
        kept: list[tuple[str, torch.Tensor]] = []

        def keep(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                if self.left_out is None or name in self.left_out:
                    kept.append((name, tensor))
                yield name, tensor

        self.llm.apply_model(_account)
        with _failed_layers() as failed:
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": keep(named_tensors), "is_checkpoint_format": True},
            )
        if failed or self.left_out:
            loaded = self.llm.apply_model(lambda model: _load_left_out(model, failed, kept))[0]
            self.left_out = set(loaded) if self.left_out is None else self.left_out
        elif self.left_out is None:
            self.left_out = set()
        self.unloaded = self.llm.apply_model(_unloaded)[0]
        if not torch.cuda.is_available():
            self.llm.apply_model(_relayout_cpu_experts)


@contextlib.contextmanager
def _failed_layers() -> Iterator[list[str]]:
    """The module paths of the layers with parameters that the reload inside leaves as they were
    (the in-process engine: its reload runs in this process)."""
    from vllm.model_executor.model_loader.reload import layerwise

    failed: list[str] = []
    finalize = layerwise.finalize_layerwise_processing

    def watched(model, model_config):
        for path, layer in model.named_modules():
            info = layerwise.get_layerwise_info(layer)
            left = info.can_load() and info.load_numel <= 0 and info.kernel_tensors is not None
            if left and info.load_numel_total > 0 and any(True for _ in layer.parameters(recurse=False)):
                failed.append(path)
        return finalize(model, model_config)

    layerwise.finalize_layerwise_processing = watched
    try:
        yield failed
    finally:
        layerwise.finalize_layerwise_processing = finalize


def _account(model) -> None:
    """From now until :func:`_unloaded`, the engine parameters the model's own loader says it loaded
    (its ``load_weights`` returns their names, as vLLM's reload reads them to warn of the rest)."""
    if not hasattr(model, "_rltrain_loaded"):
        original = model.load_weights

        def load_weights(weights, *args, **kwargs):
            names = original(weights, *args, **kwargs)
            if model._rltrain_loaded is not None:
                model._rltrain_loaded = None if names is None else model._rltrain_loaded | set(names)
            return names

        model.load_weights = load_weights
    model._rltrain_loaded = set()


def _unloaded(model) -> list[str]:
    """The engine parameters no weight of the last reload loaded, by the loader's own account (none
    named where the loader does not say what it loaded)."""
    loaded = model._rltrain_loaded
    if loaded is None:
        return []
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    names = {name for name, _ in model.named_parameters()}
    # a tied head under its own name too: a reload in place unties it, and it keeps its old values
    # unless that name loads (vLLM's loader skips only such aliases of the embeddings)
    names |= {f"{path}.{name}" for path, module in model.named_modules(remove_duplicate=False)
              if isinstance(module, VocabParallelEmbedding) for name, _ in module.named_parameters(recurse=False)}  # fmt: skip
    return sorted({name.replace(".base_layer.", ".") for name in names} - loaded)


def _load_left_out(model, failed: list[str], kept: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Load the tensors of the ``failed`` layers through the model's own loader, outside the reload:
    its direct writes then reach the kernel's tensors. A tensor belongs to a layer where its name,
    mapped as the loader maps it, is one of the layer's own parameters. Returns their names."""
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_moe_expert_param_name

    params = dict(model.named_parameters())
    owned = {
        f"{path}.{name}"
        for path in failed
        for name, _ in model.get_submodule(path).named_parameters(recurse=False)
    }
    mapper = getattr(model, "hf_to_vllm_mapper", None)

    def vllm_name(name: str) -> str:
        mapped = mapper._map_name(name) if mapper is not None else name
        return maybe_remap_moe_expert_param_name(mapped or name, params)

    left_out = [(name, tensor) for name, tensor in kept if vllm_name(name) in owned]
    if left_out:
        model.load_weights(iter(left_out))
    return [name for name, _ in left_out]


def _relayout_cpu_experts(model) -> int:
    """Redo the CPU experts' blocked layout on every layer whose experts run that kernel; returns how many."""
    layers = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.startswith("CPU"):
            experts.process_weights_after_loading(module)
            layers += 1
    return layers
