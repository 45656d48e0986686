import pytest
from pathlib import Path

@pytest.fixture(scope="session")
def toy_dir() -> Path:
    from pipelines.toy import build_toy
    return build_toy(Path(__file__).resolve().parents[2] / "runs" / "toy", progress=False)
