"""Shared test fixtures and process-wide test defaults.

The env defaults below must be set before Ray is imported anywhere, so they live at import time.
"""

import os

# Ray in tests: no usage reporting, loopback-only addresses, no token auth.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)  # the CI machines have 2 cores shared with other work

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            vocab_size=2048, max_position=2048, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A tiny Llama folder (untied embeddings, no qkv bias), made once per session."""
    from radixray.worker.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("tiny-llama")), arch="llama", **TINY)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory) -> str:
    """A tiny Qwen2 folder (tied embeddings, qkv bias), made once per session."""
    from radixray.worker.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("tiny-qwen2")), arch="qwen2",
                      tie_word_embeddings=True, **TINY)


@pytest.fixture(params=["sync", "overlap"])
def runner_kind(request):
    """For scheduler tests (scheduler_harness.py): run once without and once with overlap
    scheduling."""
    import scheduler_harness

    scheduler_harness.use_runner(request.param)
    yield request.param


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test session (start-up costs ~4 s).

    Logical CPUs are over-provisioned so tp=2 replicas and their head actors fit on the 2-core
    machines; Ray only uses the number for placement.
    """
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False,
             _node_ip_address="127.0.0.1", namespace="radixray", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def servers():
    """Servers (router/fake_worker.ServerThread) a test starts; stopped at its end, all at once."""
    started = []
    yield started
    for server in started:
        server.stop_nowait()
    for server in started:
        server.join()


@pytest.fixture
def processes():
    """Processes a test starts; killed at its end if still running."""
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
