import pytest

from helpers import make_fake_fashion


@pytest.fixture(scope="session")
def fashion_dir(tmp_path_factory):
    """A small generated dataset in Fashion-MNIST's IDX .gz format."""
    return make_fake_fashion(tmp_path_factory.mktemp("fashion"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The suite runs on several pytest-xdist workers (``--dist loadgroup``, see pyproject.toml). Tests that share
    a module-scoped fixture (a trained world, a reference run) are sent to one worker, so the fixture is built
    once, as in a single process; a test with an ``xdist_group`` of its own keeps it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        shared = sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items() if defs[-1].scope == "module")
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{'+'.join(shared)}"))
