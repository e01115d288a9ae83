"""The Tinker API served on rltrain's learners: a second front door beside the run (:mod:`rltrain.run`),
calling the same learner groups; its wire format (protobuf, futures) stays in this room.

- :mod:`~rltrain.serve.setup`: ``rltrain serve`` (config, base models, Ray, HTTP);
- :mod:`~rltrain.serve.app`: the routes the SDK calls; :mod:`~rltrain.serve.server`: what the server
  holds, and the sweep that ends silent sessions; :mod:`~rltrain.serve.models`: sessions and
  the trained model, its calls in ``seq_id`` order; :mod:`~rltrain.serve.futures`: request ids and
  long polls; :mod:`~rltrain.serve.wire`: protobuf in and out;
- :mod:`~rltrain.serve.sampling`: sampling sessions and the weights the engines hold;
  :mod:`~rltrain.serve.checkpoints`: ``tinker://`` paths and their folders.
"""
