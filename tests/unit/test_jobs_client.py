"""raydl submit / raydl jobs without a cluster: token discovery, entry points, upload checks, bad input.

Everything that can be decided before talking to a job server is checked here; the real server is in
tests/ray/test_jobs_submit.py.
"""

from __future__ import annotations

import socket
import threading
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from ray._private.runtime_env.packaging import create_package

from raydl import job_package, jobs
from raydl.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No token or address from the developer's environment or home directory."""
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_token_precedence(clean_env, monkeypatch):
    home_token = clean_env / "home" / ".ray" / "auth_token"
    home_token.parent.mkdir(parents=True)
    home_token.write_text("from-home\n")
    assert jobs.find_token() == jobs.Token("from-home", str(home_token))
    path_token = clean_env / "path_token"
    path_token.write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path_token))
    assert jobs.find_token().value == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert jobs.find_token().value == "from-env"
    flag_token = clean_env / "flag_token"
    flag_token.write_text("  from-flag \n")
    assert jobs.find_token(str(flag_token)) == jobs.Token("from-flag", f"--token-file {flag_token}")


def test_no_token_anywhere(clean_env):
    token = jobs.find_token()
    assert token.value is None and "~/.ray/auth_token" in token.source


@pytest.mark.parametrize("content", [None, "  \n"])
def test_unreadable_or_empty_token_file(clean_env, capsys, content):
    path = clean_env / "tok"
    if content is not None:
        path.write_text(content)
    assert main(["jobs", "list", "--token-file", str(path), "--address", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "--token-file" in err and "ray get-auth-token" in err


def test_address_resolution(clean_env, monkeypatch):
    assert jobs.resolve_address(None) == jobs.DEFAULT_ADDRESS
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")   # a GCS address is not a job server: ignored
    assert jobs.resolve_address(None) == jobs.DEFAULT_ADDRESS
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.5:8265")
    assert jobs.resolve_address(None) == "http://10.0.0.5:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://10.0.0.6:8265")
    assert jobs.resolve_address(None) == "http://10.0.0.6:8265"
    assert jobs.resolve_address("10.0.0.7:8265") == "http://10.0.0.7:8265"   # --address wins, http by default
    assert jobs.resolve_address("https://[::1]:8443/proxy") == "https://[::1]:8443/proxy"


@pytest.mark.parametrize("given, problem", [
    ("http://exa mple:notaport", "Port could not be cast to integer value as 'notaport'"),
    ("http://exa mple:8265", "'exa mple' is not a host name"),
    ("ftp://x", "the scheme is 'ftp', not http or https"),
    (":::", "Port could not be cast"),
    ("http://h:70000", "Port out of range"),
    ("http://[::1", "Invalid IPv6 URL"),
    ("http://:8265", "it names no host"),
])
def test_malformed_addresses_are_named_with_the_problem(clean_env, given, problem):
    with pytest.raises(jobs.JobsError) as e:
        jobs.resolve_address(given)
    assert f"address '{given}' (from --address) is not a usable URL: {problem}" in str(e.value)


def test_malformed_address_from_the_environment_names_the_variable(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://bad host:8265")
    with pytest.raises(jobs.JobsError, match="'http://bad host:8265' \\(from RAY_API_SERVER_ADDRESS\\)"):
        jobs.resolve_address(None)


@pytest.mark.parametrize("url, token, insecure, allowed", [
    ("http://127.0.0.1:8265", "t", False, True),
    ("http://127.8.9.10:8265", "t", False, True),          # all of 127.0.0.0/8 is loopback
    ("http://localhost:8265", "t", False, True),
    ("http://[::1]:8265", "t", False, True),
    ("https://10.0.0.5:8265", "t", False, True),           # encrypted
    ("http://10.0.0.5:8265", None, False, True),           # nothing secret to send
    ("http://10.0.0.5:8265", "t", True, True),             # the user said the network is trusted
    ("http://10.0.0.5:8265", "t", False, False),
    ("http://ray-head.example.com:8265", "t", False, False),
    ("http://[2001:db8::1]:8265", "t", False, False),
    ("http://0.0.0.0:8265", "t", False, False),
    ("http://localhost.example.com:8265", "t", False, False),
])
def test_token_goes_over_plain_http_only_to_loopback(url, token, insecure, allowed):
    check = lambda: jobs.check_token_transport(url, jobs.Token(token, "RAY_AUTH_TOKEN"), insecure)
    if allowed:
        check()
    else:
        with pytest.raises(jobs.JobsError, match="token would cross the network in clear text.*--insecure"):
            check()


@pytest.mark.parametrize("flag, env, expected", [(None, None, 30.0), ("2.5", None, 2.5), (None, "7", 7.0),
                                                 ("3", "7", 3.0)])
def test_http_timeout_flag_env_and_default(clean_env, monkeypatch, flag, env, expected):
    if env is not None:
        monkeypatch.setenv(jobs.HTTP_TIMEOUT_ENV, env)
    assert jobs.http_timeout(flag) == expected


@contextmanager
def silent_server():
    """A real TCP server on loopback that accepts every connection and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)   # accept() wakes up to see `stop`
    stop, held = threading.Event(), []

    def serve():
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", held
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


def call_main_with_deadline(argv: list[str], deadline_s: float) -> tuple[int | None, float]:
    """Run the CLI in a thread: a hang shows as rc None after the deadline instead of a hung test run."""
    result = {}
    t0 = time.monotonic()
    caller = threading.Thread(target=lambda: result.update(rc=main(argv)), daemon=True)
    caller.start()
    caller.join(timeout=deadline_s)
    return result.get("rc"), time.monotonic() - t0


@pytest.mark.slow   # waits for the client's timeout
@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_server_that_never_answers_times_out_naming_the_address(clean_env, monkeypatch, capsys, how):
    with silent_server() as (url, held):
        argv = ["jobs", "status", "raysubmit_x", "--address", url]
        if how == "flag":
            argv += ["--http-timeout", "0.5"]
        else:
            monkeypatch.setenv(jobs.HTTP_TIMEOUT_ENV, "0.5")
        rc, took = call_main_with_deadline(argv, deadline_s=30)
        assert held, "the CLI never connected to the test server"
    assert rc == 2, "raydl hung on a server that accepts and never answers" if rc is None else rc
    assert 0.5 <= took < 15
    err = capsys.readouterr().err
    assert f"the Ray job server at {url} did not answer within 0.5 s" in err and "--http-timeout" in err
    assert "Traceback" not in err


def test_entrypoints():
    assert job_package.entrypoint(["train", "--config", "a b.yaml"]) == "python jobs/train.py --config 'a b.yaml'"
    assert job_package.entrypoint(["sweep"]) == "python jobs/sweep.py"
    for bad in ([], ["bench"]):
        with pytest.raises(jobs.JobsError, match="train | sweep"):
            job_package.entrypoint(bad)


def test_env_pass_through(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert job_package.parse_env(["A=1", "B=x=y", "OMP_NUM_THREADS=4"]) == {"OMP_NUM_THREADS": "4", "A": "1", "B": "x=y"}
    assert job_package.parse_env([]) == {"OMP_NUM_THREADS": "3"}
    with pytest.raises(jobs.JobsError, match="KEY=VALUE"):
        job_package.parse_env(["NOVALUE"])


def test_unreachable_address_exit_2(clean_env, capsys):
    with socket.socket() as s:   # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["jobs", "status", "raysubmit_x", "--address", f"http://127.0.0.1:{port}"]) == 2
    assert f"cannot reach the Ray job server at http://127.0.0.1:{port}" in capsys.readouterr().err


def test_submit_checks_working_dir_and_config(tmp_path, capsys):
    assert main(["submit", "--working-dir", str(tmp_path), "--", "train"]) == 2
    assert "has no jobs/train.py" in capsys.readouterr().err
    outside = tmp_path / "my.yaml"
    outside.write_text("train: {max_steps: 1}\n")
    assert main(["submit", "--working-dir", str(REPO), "--", "train", "--config", str(outside)]) == 2
    assert f"--config {outside} is not a file inside --working-dir" in capsys.readouterr().err
    assert main(["submit", "--working-dir", str(REPO), "--"]) == 2
    assert "nothing to submit" in capsys.readouterr().err


def _mini_checkout(root: Path) -> Path:
    (root / "jobs").mkdir(parents=True)
    (root / "jobs" / "train.py").write_text("print('hi')\n")
    return root


def test_package_size_follows_ray_ignore_rules(tmp_path):
    wd = _mini_checkout(tmp_path / "wd")
    excludes = job_package.runtime_env(wd, env={}, excludes=[], pip=None)["excludes"]
    base = job_package.scan_package(wd, excludes).size
    for name in ("runs/big.bin", ".git/objects/pack.bin", "ignored/big.bin", "rayignored.bin", "kept.bin"):
        (wd / name).parent.mkdir(parents=True, exist_ok=True)
        (wd / name).write_bytes(b"x" * 100_000)
    (wd / ".gitignore").write_text("ignored/\n")
    (wd / ".rayignore").write_text("rayignored.bin\n")
    package = job_package.scan_package(wd, excludes)
    # only kept.bin and the two ignore files are new (each file also costs a zip header)
    assert package.files == 4 and 100_000 < package.size - base < 101_000
    # Ray matches "ignored/" against the files below it, not the folder itself ("ignored" has no slash)
    assert package.left_out == [".git", "rayignored.bin", "runs", "ignored/big.bin"]
    # The estimate is an upper bound of the zip Ray itself builds from the same directory.
    zip_path = tmp_path / "pkg.zip"
    create_package(str(wd), zip_path, include_gitignore=True, excludes=excludes)
    assert 0 <= package.size - zip_path.stat().st_size < package.files * job_package.ZIP_ENTRY_OVERHEAD + 1000


SECRETS = [".env", ".env.production", ".ray/auth_token", "deploy.pem", "tls/server.key", "hf_token.txt",
           "secrets/github_token", ".netrc", ".git/config"]


def _checkout_with_secrets(root: Path) -> Path:
    wd = _mini_checkout(root)
    for name in [*SECRETS, "raydl/data/tokenizer.py", ".env.example", "notes/local.txt", "README.md"]:
        (wd / name).parent.mkdir(parents=True, exist_ok=True)
        (wd / name).write_text(f"content of {name}\n")
    (wd / ".gitignore").write_text("notes/\n")
    return wd


def _ray_zip(wd: Path, renv: dict, out: Path) -> set[str]:
    """The zip `raydl submit` makes Ray upload: Ray's create_package with the runtime_env's excludes."""
    create_package(renv["working_dir"], out, include_gitignore=True, excludes=renv["excludes"])
    with zipfile.ZipFile(out) as z:
        return {n for n in z.namelist() if not n.endswith("/")}


def test_secrets_are_left_out_of_the_package_ray_builds(tmp_path):
    wd = _checkout_with_secrets(tmp_path / "wd")
    renv = job_package.runtime_env(wd, env={}, excludes=[], pip=None)
    uploaded = _ray_zip(wd, renv, tmp_path / "pkg.zip")
    assert uploaded == {"jobs/train.py", "raydl/data/tokenizer.py", "README.md", ".gitignore"}
    package = job_package.scan_package(wd, renv["excludes"])
    assert package.files == len(uploaded)
    assert package.left_out == [".env", ".env.example", ".env.production", ".git", ".netrc", ".ray", "deploy.pem",
                                "hf_token.txt", "notes/local.txt", "secrets/github_token", "tls/server.key"]


def test_include_uploads_a_default_exclusion_but_not_the_rest(tmp_path):
    wd = _checkout_with_secrets(tmp_path / "wd")
    renv = job_package.runtime_env(wd, env={}, excludes=["README.md"], pip=None, includes=[".env.example", "README.md"])
    uploaded = _ray_zip(wd, renv, tmp_path / "pkg.zip")
    assert uploaded == {"jobs/train.py", "raydl/data/tokenizer.py", ".gitignore", ".env.example"}   # --exclude wins


def test_submit_prints_what_it_left_out_in_one_line(tmp_path, capsys):
    wd = _checkout_with_secrets(tmp_path / "wd")
    # The package is checked before connecting; port 1 then refuses the connection (exit 2).
    assert main(["submit", "--address", "http://127.0.0.1:1", "--working-dir", str(wd), "--", "train"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "left out of the upload" in ln]
    assert lines == ["[raydl] left out of the upload: 11 paths (.env, .env.example, .env.production, .git, .netrc, "
                     "...); --include PATTERN uploads one anyway"]


def test_symlinks_inside_the_working_dir_are_fine(tmp_path):
    wd = _mini_checkout(tmp_path / "wd")
    (wd / "configs").mkdir()
    (wd / "configs" / "a.yaml").write_text("train: {max_steps: 1}\n")
    (wd / "latest.yaml").symlink_to(wd / "configs" / "a.yaml")
    (wd / "cfg").symlink_to("configs")
    (wd / "dangling").symlink_to(tmp_path / "nowhere")      # uploads nothing: Ray skips it too
    package = job_package.scan_package(wd, job_package.DEFAULT_EXCLUDES)
    assert package.files == 4 and job_package.left_out_summary(package) == "left out of the upload: nothing"


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_symlink_out_of_the_working_dir_is_refused_unless_excluded(tmp_path, kind):
    wd = _mini_checkout(tmp_path / "wd")
    target = tmp_path / "home" / ".ssh"
    target.mkdir(parents=True)
    (target / "id_ed25519").write_text("PRIVATE KEY")
    (wd / "keys").symlink_to(target if kind == "dir" else target / "id_ed25519")
    with pytest.raises(jobs.JobsError, match=f"symlink keys -> {target}"):
        job_package.scan_package(wd, job_package.DEFAULT_EXCLUDES)
    assert job_package.scan_package(wd, [*job_package.DEFAULT_EXCLUDES, "keys"]).left_out == ["keys"]


def test_working_dir_over_ray_limit_exit_2(tmp_path, monkeypatch, capsys):
    from ray._private.runtime_env import packaging

    wd = _mini_checkout(tmp_path / "wd")
    (wd / "data.bin").write_bytes(b"x" * 300_000)
    monkeypatch.setattr(packaging, "GCS_STORAGE_MAX_SIZE", 256 * 1024)   # Ray's real limit is 512 MiB
    # Checked before any connection: the address is never contacted.
    assert main(["submit", "--address", "http://127.0.0.1:1", "--working-dir", str(wd), "--", "train"]) == 2
    err = capsys.readouterr().err
    assert "would upload 0.3 MiB in 2 files, over Ray's limit of 0.2 MiB" in err and ".rayignore" in err


def test_job_entry_adds_address_only_where_the_command_takes_it(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "jobs"))
    from _entry import _accepts_address

    from raydl.cli import build_parser

    parser = build_parser()
    assert _accepts_address(parser, "train") and not _accepts_address(parser, "config")
    assert not _accepts_address(parser, "no-such-command")
