"""Bad input to `raydl submit`, `raydl jobs` and `raydl sweep`, through the CLI as a user types it.

Every case must end in one paragraph that names the input, exit code 2, no traceback, and no file
written or changed anywhere under the test's directory (which is also the working directory, so a
sweep's runs/ or a data cache would land there). None of them may reach a Ray job server or start Ray.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raydl.cli import main


def checkout(tmp: Path) -> Path:
    wd = tmp / "wd"
    (wd / "jobs").mkdir(parents=True)
    (wd / "jobs" / "train.py").write_text("print('hi')\n")
    return wd


def token_file(tmp: Path) -> str:
    (tmp / "tok").write_text("secret-token\n")
    return str(tmp / "tok")


def jobs_list(address: str | None):
    return lambda tmp: ["jobs", "list", *(["--address", address] if address else [])]


def token_to(address: str):
    return lambda tmp: ["jobs", "list", "--address", address, "--token-file", token_file(tmp)]


def submit(*extra: str, setup=lambda wd, tmp: None, address="http://127.0.0.1:1", token=False):
    """`raydl submit` of a minimal checkout; port 1 on loopback: nothing there, and never contacted."""
    def argv(tmp: Path) -> list[str]:
        wd = checkout(tmp)
        setup(wd, tmp)
        tok = ["--token-file", token_file(tmp)] if token else []
        return ["submit", "--address", address, *tok, "--working-dir", str(wd), *extra]
    return argv


def link_out(kind: str):
    def setup(wd: Path, tmp: Path) -> None:
        target = tmp / "outside"
        target.mkdir()
        (target / "id_rsa").write_text("PRIVATE KEY")
        (wd / "keys").symlink_to(target if kind == "dir" else target / "id_rsa")
    return setup


SWEEP = {"base": {"scaling": {"min_workers": 1, "max_workers": 1}, "train": {"max_steps": 100}},
         "space": {"train.global_batch_size": [32, 64]}, "objective": "samples_per_s"}


def sweep_file(*extra: str, **change):
    def argv(tmp: Path) -> list[str]:
        path = tmp / "sweep.yaml"
        path.write_text(yaml.safe_dump({**SWEEP, **change}))
        return ["sweep", "--config", str(path), *extra]
    return argv


def sweep_text(text: str):
    def argv(tmp: Path) -> list[str]:
        (tmp / "sweep.yaml").write_text(text)
        return ["sweep", "--config", str(tmp / "sweep.yaml")]
    return argv


CASES = [
    # 12: malformed addresses and timeouts, before any connection
    ("address-space-and-word-port", jobs_list("http://exa mple:notaport"), {},
     ["'http://exa mple:notaport' (from --address)", "notaport", "http://HOST:PORT"]),
    ("address-ftp", jobs_list("ftp://x"), {}, ["'ftp://x'", "scheme is 'ftp'"]),
    ("address-colons", jobs_list(":::"), {}, ["':::' (from --address)"]),
    ("address-port-range", jobs_list("http://h:99999"), {}, ["'http://h:99999'", "out of range"]),
    ("address-broken-ipv6", jobs_list("http://[::1"), {}, ["'http://[::1'", "IPv6"]),
    ("address-from-env", jobs_list(None), {"RAY_API_SERVER_ADDRESS": "http://bad host:8265"},
     ["'http://bad host:8265' (from RAY_API_SERVER_ADDRESS)"]),
    ("timeout-word", lambda tmp: ["jobs", "list", "--http-timeout", "soon"], {}, ["--http-timeout is 'soon'"]),
    ("timeout-zero", lambda tmp: ["jobs", "status", "x", "--http-timeout", "0"], {}, ["--http-timeout is '0'"]),
    ("timeout-nan", lambda tmp: ["jobs", "logs", "x", "--http-timeout", "nan"], {}, ["--http-timeout is 'nan'"]),
    ("timeout-env", jobs_list("http://127.0.0.1:8265"), {"RAYDL_HTTP_TIMEOUT_S": "-3"},
     ["RAYDL_HTTP_TIMEOUT_S is '-3'"]),
    # 18: the token never crosses the network in clear text
    ("token-http-private-ip", token_to("http://10.1.2.3:8265"), {},
     ["http://10.1.2.3:8265", "clear text", "--insecure"]),
    ("token-http-hostname", token_to("ray-head.example.com:8265"), {},
     ["http://ray-head.example.com:8265", "--token-file"]),
    ("token-http-ipv6", token_to("http://[2001:db8::1]:8265"), {}, ["http://[2001:db8::1]:8265", "clear text"]),
    ("token-env-http", jobs_list("http://192.0.2.7:8265"), {"RAY_AUTH_TOKEN": "t"},
     ["http://192.0.2.7:8265", "from RAY_AUTH_TOKEN"]),
    ("token-submit-http", submit("--", "train", address="http://192.0.2.7:8265", token=True), {},
     ["http://192.0.2.7:8265", "clear text"]),
    # 17: what would leave the machine
    ("symlink-file-out", submit("--", "train", setup=link_out("file")), {}, ["symlink keys ->", "outside/id_rsa"]),
    ("symlink-dir-out", submit("--", "train", setup=link_out("dir")), {}, ["symlink keys ->", "outside", "--exclude"]),
    ("no-entry-point", lambda tmp: ["submit", "--working-dir", str(tmp), "--", "train"], {}, ["has no jobs/train.py"]),
    ("nothing-to-submit", submit("--"), {}, ["nothing to submit after '--'"]),
    ("env-not-pair", submit("--env", "NOVALUE", "--", "train"), {}, ["--env 'NOVALUE'", "KEY=VALUE"]),
    ("pip-missing", submit("--pip", "nope.txt", "--", "train"), {}, ["--pip nope.txt"]),
    ("config-outside", submit("--", "train", "--config", "/etc/hostname"), {},
     ["--config /etc/hostname is not a file inside --working-dir"]),
    # 13: sweep files, all before Ray starts
    ("asha-reduction-1", sweep_file(asha={"reduction_factor": 1}), {}, ["'asha.reduction_factor' is 1"]),
    ("asha-grace-0", sweep_file(asha={"grace_samples": 0}), {}, ["'asha.grace_samples' is 0"]),
    ("asha-grace-over-budget", sweep_file(asha={"grace_samples": 10**6}), {}, ["'asha.grace_samples' is 1000000"]),
    ("num-samples-0", sweep_file(num_samples=0), {}, ["'num_samples' is 0"]),
    ("concurrency-negative", sweep_file(max_concurrent_trials=-1), {}, ["'max_concurrent_trials' is -1"]),
    ("empty-choice", sweep_file(space={"train.precision": "choice([])"}), {},
     ["'space.train.precision'", "choice([])"]),
    ("uniform-a-not-below-b", sweep_file(space={"train.lr": "uniform(0.01, 0.01)"}), {}, ["uniform(0.01, 0.01)"]),
    ("loguniform-zero", sweep_file(space={"train.lr": "loguniform(0, 0.1)"}), {}, ["loguniform(0, 0.1)", "0 < a < b"]),
    ("randint-a-not-below-b", sweep_file(space={"train.warmup_steps": "randint(9, 3)"}), {}, ["randint(9, 3)"]),
    ("uniform-infinite", sweep_file(space={"train.lr": "uniform(0.01, .inf)"}), {}, ["uniform(0.01, .inf)", "finite"]),
    ("objective-unknown", sweep_file(objective="accuracy"), {}, ["'objective' is 'accuracy'"]),
    ("target-missing", sweep_file(objective="time_to_target"), {}, ["'target_loss' is missing"]),
    ("target-nan", sweep_text(yaml.safe_dump({**SWEEP, "objective": "time_to_target"}) + "target_loss: .nan\n"), {},
     ["'target_loss' is nan"]),
    ("unknown-sweep-key", sweep_file(asha_config={"x": 1}), {}, ["'asha_config' is not a sweep setting"]),
    ("base-not-a-field", sweep_file(base={"train": {"learning_rate": 0.1}}), {}, ["'train.learning_rate'"]),
    ("name-escapes-runs-dir", sweep_file(name="../../elsewhere"), {}, ["'name' is '../../elsewhere'"]),
    ("set-not-a-field", sweep_file("--set", "train.max_step=5"), {}, ["'train.max_step'"]),
    ("sweep-file-missing", lambda tmp: ["sweep", "--config", str(tmp / "nope.yaml")], {},
     ["nope.yaml", "does not exist"]),
    ("sweep-yaml-python-tag", sweep_text("space: !!python/object/apply:os.system ['touch pwned']\n"), {},
     ["sweep.yaml", "not valid YAML"]),
]


def tree(root: Path) -> dict[str, tuple]:
    """Everything under root: path -> (kind, size, mtime); links by their target."""
    return {str(p.relative_to(root)): (str(p.readlink()),) if p.is_symlink() else
            (p.is_dir(), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE",
                "RAYDL_HTTP_TIMEOUT_S"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("make_argv, env, words", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_input_is_one_paragraph_exit_2_and_writes_nothing(clean_env, monkeypatch, capsys, make_argv, env, words):
    import ray

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = make_argv(clean_env)
    before = tree(clean_env)
    ray_was_up = ray.is_initialized()
    assert main(argv) == 2
    err = capsys.readouterr().err
    message = next((ln for ln in err.splitlines() if ln.startswith("raydl: error:")), err)
    for word in words:
        assert word in message, (word, err)
    assert "Traceback" not in err and "Fix:" in message
    assert tree(clean_env) == before
    assert ray.is_initialized() == ray_was_up
    assert not (clean_env / "pwned").exists()
