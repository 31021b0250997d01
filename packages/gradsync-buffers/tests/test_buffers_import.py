import gradsync.buffers


def test_imports_with_a_version() -> None:
    assert gradsync.buffers.__version__.count(".") == 2
