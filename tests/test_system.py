"""hardy runs on Linux only, and says so at `import hardy` everywhere else: one error naming the
platform and what hardy needs of Linux, before any module that needs it is loaded.

Other platforms are played here by the interpreter itself: a real `import hardy` in a fresh
process whose `sys.platform` says otherwise, as a script on that platform would run it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# A failed import takes its modules out of sys.modules again: the audit hook records each one tried.
IMPORT_AS = """import sys
tried = []
sys.addaudithook(lambda event, args: event == "import" and args[0].startswith("hardy") and tried.append(args[0]))
sys.platform = {platform!r}
try:
    import hardy
finally:
    print(tried)
"""


def import_hardy_on(platform: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", IMPORT_AS.format(platform=platform)], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("platform", ["darwin", "win32", "freebsd14", "cygwin"])
def test_import_hardy_elsewhere_than_linux_is_one_clear_error(platform):
    out = import_hardy_on(platform)
    assert out.returncode == 1
    assert (f"ImportError: hardy runs on Linux only, and this is {platform!r}. Its crash-containing workers need:"
            in out.stderr.splitlines())
    for need in ("memfd", "SCM_RIGHTS", "prctl", "/proc", "ELF", "WSL 2", "HyperNodes"):
        assert need in out.stderr
    # refused first: nothing that needs Linux was loaded (a failure deep inside would say less)
    assert out.stdout.strip() == "['hardy', 'hardy.system']"


def test_import_hardy_on_linux_loads_the_api_on_first_use():
    """`import hardy` loads its errors; the pipeline API loads when a script first names it (a fork
    server imports hardy's worker modules and never the API: a first map waits for it to boot)."""
    out = import_hardy_on(sys.platform)
    assert out.returncode == 0, out.stderr
    assert "hardy.errors" in out.stdout and "hardy.engine" not in out.stdout
    script = ("import sys, hardy\nfrom hardy import *\nimport hardy.workers.worker\n"
              "print(Pipeline.__module__, Engine.__module__, node.__module__, sorted(set(hardy.__all__) - set(dir())))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["hardy.api.pipeline", "hardy.engine.core", "hardy.model.node", "[]"]
    worker_only = subprocess.run([sys.executable, "-c", "import sys, hardy.workers.worker\n"
                                  "print(sorted(m for m in sys.modules if m.startswith('hardy.api')))"],
                                 capture_output=True, text=True, timeout=60)
    assert worker_only.stdout.strip() == "[]", worker_only.stderr
