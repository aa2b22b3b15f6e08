import pytest

from helpers import make_fake_fashion


@pytest.fixture(scope="session")
def fashion_dir(tmp_path_factory):
    """A small generated dataset in Fashion-MNIST's IDX .gz format."""
    return make_fake_fashion(tmp_path_factory.mktemp("fashion"))
