import os

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's interpreter. The variable must be set before
# any kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        import interpreter_patch  # noqa: F401 - installs itself under the flag


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Every test runs on one torch thread: the suite's tensors are tiny, and on 2 shared cores each
    multi-threaded tiny matmul waits for a descheduled worker (~30x slower); pytest -n 2 uses both."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """A test that leaves autograd switched off (a bare ``torch.set_grad_enabled(False)``, a mode
    entered and not exited) fails here, instead of the next test in its process that needs grad."""
    yield
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left autograd disabled (grad mode off or inference mode on)")


def pytest_ignore_collect(collection_path, config):
    """Under ``-m slow`` (``make test-slow``), only the modules that mark a test slow are imported:
    collecting the whole suite to run its few slow tests was a third of that step on a two-core
    machine. Any other marker expression collects everything."""
    if config.getoption("markexpr", "") != "slow":
        return None
    name = collection_path.name
    if collection_path.suffix == ".py" and name.startswith("test_") and "mark.slow" not in collection_path.read_text():
        return True
    return None
