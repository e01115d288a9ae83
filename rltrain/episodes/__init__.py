"""Episodes, token-in/token-out: how a prompt becomes turns, tool calls and their results.

- :mod:`~rltrain.episodes.environments`: the protocol an environment subclasses and the built-in
  ones (public path: :mod:`rltrain.envs`); :mod:`~rltrain.episodes.env_host`: environments and
  their tools in worker processes with deadlines;
- :mod:`~rltrain.episodes.turns`: one episode per request, turn by turn;
  :mod:`~rltrain.episodes.episode_state`: one episode's bookkeeping, shared by every multi-turn path;
- :mod:`~rltrain.episodes.tools` (the tool loop, the calculator, the sandboxed python tool,
  :mod:`~rltrain.sandbox`), :mod:`~rltrain.episodes.parsers` (tool calls in the model's
  own format), :mod:`~rltrain.episodes.chat` (the chat template's tokens for what a turn adds);
- :mod:`~rltrain.episodes.gateway` and :mod:`~rltrain.episodes.agents`: black-box agents through an
  OpenAI-compatible gateway; :mod:`~rltrain.episodes.verifiers_env`: verifiers' tasksets through it.

It hands completions (their token ids, masks, log-probs and the episode's own reward) to the
rollout's engines, which call it with a ``generate`` function; it imports no engine.
"""
