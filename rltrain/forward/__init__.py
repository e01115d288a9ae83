"""How a model runs a row, exactly: the room between the loss library (:mod:`rltrain.loss`, pure
math) and the learners (:mod:`rltrain.learner`, engines and objectives).

- :mod:`~rltrain.forward.row`: the entry point. A :class:`RowLayout` built once per micro-batch
  (padded rows, one packed row, a prefix tree; its images) and what is asked of it: per-token
  log-probs (:func:`logprobs`, :func:`sequence_logprobs`) and a small head's outputs (:func:`outputs`);
- :mod:`~rltrain.forward.layouts`: the padded and packed forwards; :mod:`~rltrain.forward.tree`:
  prefix trees (each shared prompt once) and their forward;
- :mod:`~rltrain.forward.structure`: a row's documents and branches, read from its position ids,
  and the row each model's running forward announced (:class:`~rltrain.forward.structure.RowContext`,
  one a model);
- :mod:`~rltrain.forward.attention`: the attention function registered with transformers (piece by
  piece, windows, sinks, soft-caps); :mod:`~rltrain.forward.recurrent`: recurrent layers' state kept
  per sequence; :mod:`~rltrain.forward.vision`: images in a forward;
- :mod:`~rltrain.forward.head`: the head from the last hidden states, the family's logit transform
  folded in and checked on a probe; :mod:`~rltrain.forward.model`: the model under its wrappers.

It imports the loss library and nothing else of rltrain.
"""

# ruff: noqa: I001  (the exports)
from rltrain.forward.head import (LogitTransform, PROBE_TOKENS, TransformedHead, head_forward, logit_transform,
                                  output_head, probing)  # fmt: skip
from rltrain.forward.layouts import (pack_sequences, packed_forward, padded_forward, text_positions, token_outputs,
                                     trailing_order, unordered)  # fmt: skip
from rltrain.forward.model import causal_lm, model_config, multi_axis_positions
from rltrain.forward.row import RowLayout, logprobs, outputs, sequence_logprobs, target_logprobs
from rltrain.forward.tree import PrefixTree, build_tree, first_index, token_keys, tree_logprobs, tree_outputs

__all__ = ["PROBE_TOKENS", "LogitTransform", "PrefixTree", "RowLayout", "TransformedHead", "build_tree", "causal_lm",
           "first_index", "head_forward", "logit_transform", "logprobs", "model_config", "multi_axis_positions",
           "output_head", "outputs", "pack_sequences", "packed_forward", "padded_forward", "probing",
           "sequence_logprobs", "target_logprobs", "text_positions", "token_keys", "token_outputs", "trailing_order", "tree_logprobs",
           "tree_outputs", "unordered"]  # fmt: skip
