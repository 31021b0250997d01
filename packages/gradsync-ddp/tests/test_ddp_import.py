import gradsync.ddp


def test_imports_with_a_version() -> None:
    assert gradsync.ddp.__version__.count(".") == 2
