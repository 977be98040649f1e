"""Fixtures shared across test files."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels run only in Triton's interpreter (on CPU tensors), which must be
# on before triton is first imported: it decides when a kernel is decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines run eagerly unless a test asks for the compiled model (engine.model.compiled): compiling
# costs seconds to minutes per engine. Set here, so Ray processes started by tests inherit it too.
os.environ["SLOTSERVE_ENFORCE_EAGER"] = "1"
# Routing tests assert which replica serves a request. Serve skips a replica whose queue-length
# probe misses its deadline (0.1 s by default) and takes the next rank; on a loaded 2-core host the
# first probe of a new handle can take longer than that. Set before ray is imported (and inherited
# by the Ray processes the tests start).
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    """The built-in default model converted to an HF directory, once per test session.

    Converts into $SLOTSERVE_CACHE when set (so repeated runs reuse it), else into a
    temporary directory (~15 s on a 2-core machine).
    """
    from engine.models_hub import DEFAULT_MODEL, resolve_model

    cache = os.environ.get("SLOTSERVE_CACHE") or tmp_path_factory.mktemp("slotserve-models")
    return resolve_model(DEFAULT_MODEL, cache_dir=cache)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a tiny byte-level BPE tokenizer (ChatML template)."""
    from tests.factories import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer, as the ingress loads it."""
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA (and, for the flash backend, flash-attn): skipped elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without interpreter teardown once every plugin has reported.

    Threads that outlive their tests (daemon engine loops, Ray's client threads, OpenMP teams)
    can still be in native code while C++ static destructors run at exit, and a crash there
    would replace the suite's own exit status with a signal."""
    if _EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT_STATUS])


_EXIT_STATUS = pytest.StashKey[int]()
