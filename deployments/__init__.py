"""slotserve's Ray Serve layer: the only package (with router/'s adapters) that imports ray.

- ``app.build_app`` turns a validated config into a Serve application: a ``Router``
  ingress (gRPC servicer methods + the OpenAI HTTP API) in front of N ``EngineReplica``
  deployments, one ``engine.AsyncEngine`` each.
- ``frontend.Frontend`` is the protocol-neutral core of the ingress (validation,
  tokenization, chat templates, incremental detokenization, stop strings); it does not
  import ray, so it is tested in-process against a fake engine (tests/fake_engine.py).

Importing this package is cheap: modules that pull in ray or torch load on use.
"""
