import signal

import pytest

from helpers import make_fake_fashion

# A suite started under nohup inherits SIGHUP ignored, and so would every command a test starts: the tests that send
# SIGHUP to one expect what a terminal's SIGHUP does (abtrain keeps a SIGHUP ignored by its starter ignored).
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.fixture(scope="session")
def fashion_dir(tmp_path_factory):
    """A small generated dataset in Fashion-MNIST's IDX .gz format."""
    return make_fake_fashion(tmp_path_factory.mktemp("fashion"))


#: The files the two test processes (pyproject.toml: ``-n 2 --dist loadfile --no-loadscope-reorder``) take up
#: first, longest first, so that both finish at about the same time; the other files follow in their usual order.
LONGEST_FIRST = ("test_reliability.py", "test_bench.py", "test_cli.py", "test_multinode.py", "test_restart.py",
                 "test_efmethods.py", "test_fetch.py", "test_registry.py", "test_faults.py", "test_ddp.py",
                 "test_lightning.py", "test_launch.py", "test_checkpoint.py", "test_validation.py", "test_baselines.py",
                 "test_ab.py", "test_api.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
