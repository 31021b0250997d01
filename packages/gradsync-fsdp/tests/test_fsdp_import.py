import gradsync.fsdp


def test_imports_with_a_version() -> None:
    assert gradsync.fsdp.__version__.count(".") == 2
