import gradsync.finalize


def test_imports_with_a_version() -> None:
    assert gradsync.finalize.__version__.count(".") == 2
