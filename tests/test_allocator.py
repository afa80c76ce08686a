"""tcmalloc for the model commands (allocator.py): `serve` and `demo` re-execute once with it
preloaded where it is installed; never twice, never over the user's choice, never in-process."""

import os
import subprocess
import sys

import pytest

from agentserve import allocator


@pytest.fixture
def lib(tmp_path):
    path = tmp_path / "libtcmalloc_minimal.so.4"
    path.write_bytes(b"")
    return str(path)


def test_serve_and_demo_preload_it_once(lib):
    for command in ("serve", "demo"):
        env = allocator.reexec_env({"PATH": "/bin"}, command, [lib])
        assert env == {"PATH": "/bin", "LD_PRELOAD": lib, allocator.DONE: "1"}
        assert allocator.reexec_env(env, command, [lib]) is None  # the re-executed process runs as it is
    kept = allocator.reexec_env({"LD_PRELOAD": "/x/libfoo.so"}, "serve", [lib])
    assert kept is not None and kept["LD_PRELOAD"] == f"{lib}:/x/libfoo.so"  # others stay preloaded


@pytest.mark.parametrize("env,command", [
    ({}, "sim"), ({}, "bench"), ({}, None),  # commands that do not run the served model
    ({allocator.CHOICE: "system"}, "serve"),  # the user's choice
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "serve"),  # the user's own allocator
])
def test_it_is_left_alone(lib, env, command):
    assert allocator.reexec_env(env, command, [lib]) is None


def test_without_the_library_the_command_runs_on_glibc(tmp_path):
    assert allocator.reexec_env({}, "serve", [str(tmp_path / "absent.so")]) is None
    assert allocator.describe({}).startswith("glibc malloc (install")
    assert allocator.describe({"LD_PRELOAD": "/a/libtcmalloc_minimal.so.4"}) == "tcmalloc (LD_PRELOAD)"


def test_serve_logs_the_allocator_it_runs_on():
    """The real command line, up to the model load (an unknown model fails right after the log
    line, with the CLI's message rather than a traceback)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.DONE, allocator.CHOICE)}
    out = subprocess.run([sys.executable, "-m", "agentserve.cli", "serve", "--model", "no-such-model"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "agentserve serve: --model: model 'no-such-model' is not a bundled model" in out.stderr
    want = "tcmalloc (LD_PRELOAD)" if allocator.find_tcmalloc() else "glibc malloc (install"
    assert f"memory allocator: {want}" in out.stderr


def test_an_in_process_main_never_replaces_the_process():
    code = ("import os\nfrom agentserve import cli\n"
            "try:\n    cli.main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('RESULT', os.environ.get('LD_PRELOAD', ''))")  # an exec'd serve --help would print no RESULT
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.DONE)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    stdout, _ = proc.communicate(timeout=120)
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT"))
    assert line == "RESULT "
