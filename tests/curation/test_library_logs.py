"""curation/library_logs.py in a process of its own (it changes the process's logging): each
library's records, Python warnings and C++ output go to the file; groupforge's own warnings and
Python's sys.stderr stay on the console; no file until the first record."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import REPO

SCRIPT = textwrap.dedent("""
    import logging, os, sys, warnings
    from pathlib import Path
    from curation.library_logs import library_log, log_libraries_to, native_output_to_log

    path = Path(sys.argv[1])
    assert log_libraries_to(path, "groupforge test") == path and library_log() == path
    assert not path.exists(), "made before the first record"
    from transformers.utils import logging as hf_logging
    hf_logging.get_logger("transformers.models.llama").warning("from transformers")
    logging.getLogger("torch.distributed").warning("from torch")
    logging.getLogger("vllm.engine").info("from vllm")
    warnings.warn_explicit("from a library", FutureWarning, "/site-packages/lib.py", 3)
    warnings.warn_explicit("from groupforge", UserWarning, str(Path("curation/x.py").resolve()), 7)
    with native_output_to_log():
        os.write(2, b"native from C++\\n")
        print("python stderr", file=sys.stderr, flush=True)
    print("after", file=sys.stderr)
""")


def test_library_output_goes_to_the_log_and_groupforge_output_to_the_console(tmp_path):
    log = tmp_path / "logs" / "x.log"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert text.startswith("---- groupforge test, pid ")
    for line in ("WARNING transformers.models.llama: from transformers", "WARNING torch.distributed: from torch",
                 "INFO vllm.engine: from vllm", "FutureWarning: from a library", "native from C++"):
        assert line in text, text
    assert "from groupforge" not in text and "python stderr" not in text
    console = done.stderr.splitlines()
    assert any("UserWarning: from groupforge" in line for line in console), done.stderr
    assert "python stderr" in console and "after" in console
    assert not any(word in done.stderr for word in ("from transformers", "from torch", "from vllm", "from a library",
                                                      "native"))
