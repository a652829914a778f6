"""--prompts NAME: the shipped files are their sources, every name resolves offline (shipped, or from a hub cache laid
out as the real one) or is refused in one line before anything is written, and a fetch keeps only the pinned file."""
import contextlib
import gzip
import hashlib
import http.server
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import common
from helpers import ROOT, TRAINERS

SETS = common.ASSETS / "prompt_sets"
NOTICE_ROW = re.compile(r"^\| `(\S+)` \| `(\S+)` \| `([0-9a-f]{40})` \| `([0-9a-f]{64})` \| (\d+) \| (\d+) \|$", re.M)
FETCHED = {"ocr", "geneval", "hpdv2"}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def notice() -> dict:
    """The README.md beside the shipped files: file -> (source, git blob id, sha256, bytes, prompts)."""
    return {m[0]: m[1:] for m in NOTICE_ROW.findall((SETS / "README.md").read_text())}


def cache_fetched(hub: Path, name: str, train: str, held_out: str, monkeypatch) -> list[Path]:
    """The files of set `name` that are not shipped, laid out in `hub` as prompt_file keeps them, and their paths:
    HPDv2's in the hub's own layout (datasets--OWNER--NAME/snapshots/REVISION/FILE, a link to blobs/SHA256),
    Flow-GRPO's under prompt-sets/OWNER/NAME/COMMIT/, the stand-in's git blob id pinned in its place."""
    paths = []
    for i, (source, text) in enumerate(zip(common.PROMPT_SETS[name], (train, held_out))):
        if source[0].endswith(".gz"):  # shipped
            continue
        data = text.encode()
        if name == "hpdv2":
            repo = hub / f"datasets--{common.HPDV2.replace('/', '--')}"
            path = repo / "snapshots" / common.REVISIONS[common.HPDV2] / source[0]
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            path.symlink_to(Path("..", "..", "blobs", blob.name))
        else:
            path = hub / "prompt-sets" / common.FLOW_GRPO / common.REVISIONS[common.FLOW_GRPO] / source[0]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            sources = list(common.PROMPT_SETS[name])
            sources[i] = (source[0], git_blob_id(data))
            monkeypatch.setitem(common.PROMPT_SETS, name, tuple(sources))
        paths.append(path)
    return paths


def test_every_shipped_file_is_its_source_file_and_held_out_split(empty_hub, monkeypatch):
    for name in ("ocr", "geneval"):  # their train files are fetched: a stand-in
        cache_fetched(empty_hub, name, '{"prompt": "p"}\n', "", monkeypatch)
    rows = notice()
    shipped = {s[0]: s[1] for sources in common.PROMPT_SETS.values() for s in sources if s[0].endswith(".gz")}
    assert shipped == {file: row[1] for file, row in rows.items()}  # each pinned to its blob id
    assert (SETS / "LICENSE").read_text().startswith("MIT License")
    for file, (source, blob, sha256, size, count) in rows.items():
        data = gzip.decompress((SETS / file).read_bytes())
        assert (git_blob_id(data), hashlib.sha256(data).hexdigest(), len(data)) == (blob, sha256, int(size)), file
        assert file == source + ".gz"
        lines = [ln.strip() for ln in data.decode().splitlines() if ln.strip()]
        assert len(lines) == int(count), file
        name = file.split("/")[0]
        train, held_out = common.load_prompts(name, "sd3")
        split = held_out if "test" in file else train
        want = [json.loads(ln) for ln in lines] if file.endswith(".jsonl.gz") else [{"prompt": ln} for ln in lines]
        assert split == want, file  # the set's split is the source file, line by line, metadata kept
    assert notice()["geneval/test_metadata.jsonl.gz"][4] == "2212"


@pytest.mark.parametrize("name", common.PROMPT_SETS)
def test_every_name_resolves_offline_or_is_refused_until_its_files_are_in_the_cache(name, empty_hub, monkeypatch):
    if name not in FETCHED:
        train, held_out = common.load_prompts(name, "flux")
        assert train and held_out
        return
    with pytest.raises(common.UsageError) as e:
        common.load_prompts(name, "flux")
    assert re.fullmatch(rf"--prompts {name} needs \S+, not in the hub cache while offline: fetch it with "
                        rf"`HF_HUB_OFFLINE=0 python common\.py fetch-prompts {name}` \(a failed download keeps "
                        rf"nothing\)", str(e.value)), str(e.value)
    if name == "hpdv2":  # records of image pairs: their distinct prompts, in order
        records = [{"prompt": "a cat", "x": 1}, {"prompt": "a dog"}, {"prompt": "a cat"}]
        cache_fetched(empty_hub, name, json.dumps(records), json.dumps([{"prompt": "a fox"}]), monkeypatch)
        assert common.load_prompts(name, "flux") == ([{"prompt": "a cat"}, {"prompt": "a dog"}], [{"prompt": "a fox"}])
        return
    record = {"prompt": 'a sign that says "hi"', "tag": "t"}
    cache_fetched(empty_hub, name, json.dumps(record) if name == "geneval" else record["prompt"], "", monkeypatch)
    train, held_out = common.load_prompts(name, "flux")
    assert train == [record if name == "geneval" else {"prompt": record["prompt"]}]  # GenEval's keep their metadata
    assert held_out == common.load_prompts(name, "sd3")[1] and len(held_out) == {"ocr": 1018, "geneval": 2212}[name]


@pytest.mark.parametrize("damage", ["another shipped file", "edited", "not gzip", "a FIFO"])
def test_a_shipped_file_that_is_not_its_pinned_blob_is_one_line(damage, tmp_path, monkeypatch):
    """A set recorded as NAME@REVISION is that revision's: before, a shipped file replaced by another was read and
    recorded under the shipped blob id."""
    shutil.copytree(SETS, tmp_path / "prompt_sets")
    monkeypatch.setattr(common, "ASSETS", tmp_path)
    path = tmp_path / "prompt_sets" / "drawbench" / "test.txt.gz"
    assert len(common.load_prompts("drawbench", "sd3")[1]) == 1000
    path.unlink()
    if damage == "another shipped file":
        shutil.copy(SETS / "pickscore" / "test.txt.gz", path)
    elif damage == "edited":
        path.write_bytes(gzip.compress(gzip.decompress((SETS / "drawbench" / "test.txt.gz").read_bytes()) + b"x\n"))
    elif damage == "not gzip":
        path.write_bytes(gzip.decompress((SETS / "drawbench" / "test.txt.gz").read_bytes()))
    else:
        os.mkfifo(path)
    error = within(10, lambda: common.load_prompts("drawbench", "sd3"))
    assert str(error) == f"--prompts drawbench: {path} is not the file pinned (8d96e7cf7017ce6ce299a6eec96e21467a2ac7" \
                         f"aa), changed or damaged since: restore it (git checkout -- assets/prompt_sets)", error


def test_an_hpdv2_cache_of_plain_files_is_checked_against_the_hubs_blob_of_its_bytes(empty_hub, monkeypatch):
    """A hub cache copied without its links (cp -rL) keeps each file's bytes and its blob, named by their hash: a
    file changed since is refused, as in a cache with links; before, a plain file was never compared."""
    good = json.dumps([{"prompt": "a cat"}])
    paths = cache_fetched(empty_hub, "hpdv2", good, json.dumps([{"prompt": "a fox"}]), monkeypatch)
    for path in paths:  # the links replaced by copies of their blobs
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
    assert common.load_prompts("hpdv2", "flux") == ([{"prompt": "a cat"}], [{"prompt": "a fox"}])
    paths[0].write_text(good.replace("cat", "dog"))
    error = within(10, lambda: common.load_prompts("hpdv2", "flux"))
    assert str(error) == f"--prompts hpdv2: {paths[0]} is not the file pinned (the hub's blob of its bytes), changed " \
                         f"or damaged since: delete it, then fetch it with `HF_HUB_OFFLINE=0 python common.py " \
                         f"fetch-prompts hpdv2`", error
    paths[0].write_text(good)
    shutil.rmtree(paths[0].parents[2] / "blobs")  # the bytes as they were, but nothing names them
    assert isinstance(within(10, lambda: common.load_prompts("hpdv2", "flux")), common.UsageError)


def test_a_set_is_recorded_with_its_revision_and_read_only_at_it():
    flow_grpo = importlib.import_module("flow_grpo")
    args = common.cli(flow_grpo.Args, ["--model", "sd3", "--prompts", "pickscore"], flow_grpo.MODEL_DEFAULTS)
    assert args.prompts == "pickscore@" + common.REVISIONS[common.FLOW_GRPO]
    assert common.load_prompts(args.prompts, "sd3") == common.load_prompts("pickscore", "sd3")
    with pytest.raises(common.UsageError, match=f"this code reads {common.REVISIONS[common.FLOW_GRPO]}: pass "
                                                f"--prompts drawbench"):
        common.load_prompts("drawbench@0123456", "sd3")
    with pytest.raises(common.UsageError, match="the toy model's prompts are its own: leave --prompts out"):
        common.load_prompts("pickscore", "toy")


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_set_not_cached_offline_is_one_line_before_anything_is_written_or_loaded(trainer, empty_hub, tmp_path,
                                                                                   capsys, monkeypatch):
    module = importlib.import_module(trainer)
    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    argv = ["--model", "sd3", "--model-path", "random:1", "--reward", "jpeg", "--prompts", "ocr", "--output-dir",
            str(tmp_path / "run")]
    for call in (lambda: common.run_cli(module.main, module.Args, module.MODEL_DEFAULTS, argv),
                 lambda: common.evaluate_main(["--model", "sd3", "--model-path", "random:1", "--reward", "jpeg",
                                               "--prompts", "hpdv2", "--output", str(tmp_path / "run")])):
        with pytest.raises(SystemExit) as stop:
            call()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "fetch it with `HF_HUB_OFFLINE=0 python common.py fetch-prompts " in err, err
        assert not (tmp_path / "run").exists() and not empty_hub.exists()


class FileServer:
    """A local HTTP server for the fetch tests: each path of `files` answers its bytes, declaring `declared` bytes
    (default: their length), so a shorter body is a download cut short. Serves until the block ends."""

    def __init__(self, files: dict[str, tuple[bytes, int | None]]):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path not in files:
                    self.send_error(404)
                    return
                body, declared = files[self.path]
                self.send_response(200)
                self.send_header("Content-Length", str(declared or len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *args):
                pass
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.timeout = 5

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_a_fetch_keeps_only_the_pinned_file_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    good = "".join(f"a poster that says \"{i}\"\n" for i in range(50)).encode()
    path = "dataset/ocr/train.txt"
    monkeypatch.setitem(common.PROMPT_SETS, "ocr", ((path, git_blob_id(good)), common.PROMPT_SETS["ocr"][1]))
    url_path = f"/{common.FLOW_GRPO}/{common.REVISIONS[common.FLOW_GRPO]}/{path}"
    cached = hub / "prompt-sets" / common.FLOW_GRPO / common.REVISIONS[common.FLOW_GRPO] / path
    for body, declared, why in [(good[:100], len(good), r"not fetched \(IncompleteRead"),  # cut short
                                (good.replace(b"7", b"8"), None, r"not fetched \(ValueError: not git blob"),  # altered
                                (b"", None, "not git blob")]:
        with FileServer({url_path: (body, declared)}) as url:
            monkeypatch.setattr(common, "RAW_GITHUB", url)
            with pytest.raises(common.UsageError, match=why):
                common.load_prompts("ocr", "sd3")
        assert not hub.exists() or not any(p.is_file() for p in hub.rglob("*")), list(hub.rglob("*"))
    with FileServer({url_path: (good, None)}) as url:
        monkeypatch.setattr(common, "RAW_GITHUB", url)
        train, held_out = common.load_prompts("ocr", "sd3")
    assert cached.read_bytes() == good and [p for p in hub.rglob("*") if p.is_file()] == [cached]
    assert train == [{"prompt": f'a poster that says "{i}"'} for i in range(50)] and len(held_out) == 1018
    monkeypatch.setattr(common, "RAW_GITHUB", "http://127.0.0.1:9")  # nothing listens: the cached file is read
    assert common.load_prompts("ocr", "sd3")[0] == train
    with contextlib.suppress(FileNotFoundError):
        cached.unlink()
    with pytest.raises(common.UsageError, match=r"not fetched \(URLError: .*a failed download keeps nothing"):
        common.load_prompts("ocr", "sd3")


@pytest.mark.parametrize("train,held_out", [
    ({"prompt": "not a list"}, []),
    ([{"prompt": 5}], [{"prompt": "a fox"}]),
    ([{"prompt": ["a", "cat"]}], [{"prompt": "a fox"}]),
    ([{"prompt": "  "}], [{"prompt": "a fox"}]),
    ([{"text": "a cat"}], [{"prompt": "a fox"}]),
    ([], [{"prompt": "a fox"}]),
    ([{"prompt": "a cat"}], []),
])
@pytest.mark.parametrize("trainer", TRAINERS[:1])
def test_hpdv2_records_without_a_non_empty_string_prompt_are_one_line_before_the_run_folder(
        trainer, train, held_out, empty_hub, tmp_path, capsys, monkeypatch):
    cache_fetched(empty_hub, "hpdv2", json.dumps(train), json.dumps(held_out), monkeypatch)
    module = importlib.import_module(trainer)
    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as stop:
        common.run_cli(module.main, module.Args, module.MODEL_DEFAULTS, [
            "--model", "sd3", "--model-path", "random:1", "--reward", "jpeg", "--prompts", "hpdv2", "--output-dir",
            str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "is not HPDv2's list of records, each with a non-empty string 'prompt' (both splits holding some): " \
           "delete it" in err, err
    assert not (tmp_path / "run").exists()


def within(seconds: float, call):
    """call() in a thread: its result or exception, or a failure if it has not returned after `seconds` (a hang)."""
    box = []
    thread = threading.Thread(target=lambda: box.append(_outcome(call)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"no answer in {seconds} s: a read that waits"
    return box[0]


def _outcome(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - returned for the test to look at
        return e


@pytest.mark.parametrize("name", ["ocr", "hpdv2"])
@pytest.mark.parametrize("damage", ["edited", "cut short", "a FIFO", "a folder"])
def test_a_cached_file_is_checked_at_every_start_and_a_damaged_one_is_one_line_never_a_hang(name, damage, empty_hub,
                                                                                            monkeypatch):
    """Flow-GRPO's file against its pinned git blob id, HPDv2's against the hash the hub names its blob after."""
    good = json.dumps([{"prompt": "a cat"}]) if name == "hpdv2" else "a sign that says 'hi'\n" * 3
    path = cache_fetched(empty_hub, name, good, json.dumps([{"prompt": "a fox"}]), monkeypatch)[0]
    assert common.load_prompts(name, "flux")[0][0]["prompt"] in ("a cat", "a sign that says 'hi'")
    target = path.resolve()                                            # HPDv2's: the blob the snapshot links to
    if damage == "edited":
        target.write_text(good.replace("a", "o"))
    elif damage == "cut short":
        target.write_text(good[:-3])
    else:
        target.unlink()
        os.mkfifo(target) if damage == "a FIFO" else target.mkdir()
    error = within(10, lambda: common.load_prompts(name, "flux"))
    assert isinstance(error, common.UsageError), error
    pinned = target.name if name == "hpdv2" else common.PROMPT_SETS[name][0][1]
    assert str(error) == f"--prompts {name}: {path} is not the file pinned ({pinned}), changed or damaged since: " \
                         f"delete it, then fetch it with `HF_HUB_OFFLINE=0 python common.py fetch-prompts {name}`"


def test_fetch_prompts_has_its_usage_and_refuses_an_unknown_set_in_one_line():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "common.py"), "fetch-prompts", "--help"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: common.py fetch-prompts [-h] NAME [NAME ...]"), out
    assert "pickscore, hpdv2, ocr, geneval, drawbench" in out.stdout and out.stderr == "", out
    out = subprocess.run([sys.executable, str(ROOT / "common.py"), "fetch-prompts", "pickscore", "nope"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and out.stdout == "" and out.stderr == (
        "common.py fetch-prompts: error: argument NAME: invalid choice: 'nope' (choose from 'pickscore', 'hpdv2', "
        "'ocr', 'geneval', 'drawbench')\n"), out


def test_an_unreachable_hub_is_one_line_at_once_without_retries(tmp_path, monkeypatch, caplog, capsys):
    """The network allowed but nothing answers at the hub's address: no retries over tens of seconds, no log lines."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    slept, sleep = [], time.sleep  # a retry waits first: the waits are counted, not the machine's seconds
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s) or sleep(min(s, 0.01)))
    with pytest.raises(common.UsageError, match=r"^--prompts hpdv2 needs train.json, not fetched \((ConnectError|"
                                                r"ConnectionError)"):
        common.load_prompts("hpdv2", "flux")
    assert sum(slept) < 1, slept
    assert not caplog.records and not capsys.readouterr().err
    assert not (tmp_path / "hub").exists() or not any(p.is_file() for p in (tmp_path / "hub").rglob("*"))


def test_a_gzipped_prompt_file_is_read_and_one_that_does_not_decompress_is_one_line(tmp_path):
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "a cat", "split": "eval"}\n{"prompt": "a dog"}\n'))
    assert common.load_prompts(str(tmp_path / "p.jsonl.gz"), "sd3") == ([{"prompt": "a dog"}],
                                                                        [{"prompt": "a cat", "split": "eval"}])
    whole = gzip.compress(b"a cat\n" * 20)
    for name, data in [("cut.txt.gz", whole[:-6]), ("plain.txt.gz", b"a cat\n")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(common.UsageError, match=rf"^prompt file '\S+{name}' does not read as gzip \((EOFError|"
                                                    rf"BadGzipFile): .*\): write it again$"):
            common.load_prompts(str(tmp_path / name), "sd3")
