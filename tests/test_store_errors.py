"""Every bad cache file is one MlxkvError line (exit code 1) and leaves the output untouched."""

import json
import shutil

import mlx.core as mx
import pytest

from kvcore.errors import MlxkvError
from kvcore.policy import KVOptions
from kvcore.store import open_cache_file
from kvcore.store.atomic import atomic_write
from store_helpers import DOC, cli, edit_doc, job, join, set_doc, split

OPTS = KVOptions(max_kv_size=48, keep=4, kv_bits=4, kv_group_size=32, quantized_kv_start=0)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    f = tmp_path_factory.mktemp("good") / "good.kv"
    job(DOC * 2, None, 4, OPTS, save_cache=str(f))
    return f


def _flip_data_byte(good, out):
    header, data = split(good)
    name = "layers.1.2"  # an encoded part of layer 1
    b, _ = header[name]["data_offsets"]
    data = bytearray(data)
    data[b + 3] ^= 0x40
    out.write_bytes(join(header, bytes(data)))


def _drop_array(good, out):
    arrays, meta = mx.load(str(good), format="safetensors", return_metadata=True)
    del arrays["layers.0.1"]
    mx.save_safetensors(str(out) + ".safetensors", arrays, metadata=meta)  # _make renames it


def _doc(change):
    return lambda good, out: edit_doc(good, out, change)


def _raw(change):
    return lambda good, out: out.write_bytes(change(good.read_bytes()))


def _set(path: list, value):
    def change(doc):
        d = doc
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return change


CASES = {
    "missing": (None, "cache file not found"),
    "directory": ("dir", "is a directory"),
    "empty": (_raw(lambda b: b""), "truncated"),
    "truncated data": (_raw(lambda b: b[:-100]), "truncated"),
    "truncated header": (_raw(lambda b: b[:60]), "invalid header length"),
    "header length": (_raw(lambda b: (2**40).to_bytes(8, "little") + b[8:]), "invalid header length"),
    "header json": (_raw(lambda b: b[:8] + b"x" + b[9:]), "not valid JSON"),
    "mlxkv json": (_doc(lambda d: None), None),  # replaced below: a broken document string
    "version": (_doc(_set(["version"], 9)), "unsupported format version 9"),
    "format": (_doc(_set(["format"], "other")), "unknown format 'other'"),
    "header shape": (_doc(_set(["arrays", "layers.0.0", "shape"], [1, 2, 3])), "in the header"),
    "layer shape": (_doc(_set(["layers", 0, "dims"], [1, 4, 8, 16])), "its layer needs"),
    "layer field": (_doc(_set(["layers", 1, "keep"], "four")), "'keep' must be an integer"),
    "layer kind": (_doc(_set(["layers", 1, "kind"], "Pickle")), "'kind' must be one of"),
    "prefix length": (_doc(_set(["prefix_tokens"], 7)), "tokens, the prefix has 7"),
    "checksum": (_flip_data_byte, "checksum mismatch for array 'layers.1.2'"),
    "checksum header": (_doc(_set(["arrays", "prefix_ids", "sha256"], "0" * 64)), "checksum mismatch"),
    "missing array": (_drop_array, "missing array 'layers.0.1'"),
    "not mlxkv": (lambda good, out: mx.save_safetensors(str(out) + ".safetensors", {"a": mx.zeros(3)}),
                  "not an mlxkv cache"),
}


def _broken_doc(good, out):
    header, data = split(good)
    set_doc(header, header["__metadata__"]["mlxkv"][:-5])
    out.write_bytes(join(header, data))


CASES["mlxkv json"] = (_broken_doc, "mlxkv header is not valid JSON")


def _make(case, good, tmp_path):
    build, _ = CASES[case]
    out = tmp_path / "bad.kv"
    if build == "dir":
        out.mkdir()
    elif build is not None:
        build(good, out)
        if not out.exists() and (tmp_path / "bad.kv.safetensors").exists():
            (tmp_path / "bad.kv.safetensors").rename(out)
    return out


def _one_line_error(r, message):
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.output, r.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_bad_cache_file(good, tmp_path, case):
    bad, message = _make(case, good, tmp_path), CASES[case][1]
    with pytest.raises(MlxkvError) as e:
        open_cache_file(bad)
    assert message in str(e.value) and "\n" not in str(e.value)
    out = tmp_path / "out.kv"
    out.write_bytes(b"keep me")
    _one_line_error(cli("generate", "-p", "x", "-n", "2", "--load-cache", bad, "--save-cache", out), message)
    _one_line_error(cli("convert-kv", bad, out, "--kv-bits", "8"), message)
    _one_line_error(cli("inspect-cache", bad), message)
    assert out.read_bytes() == b"keep me"


def test_the_good_file_is_good(good):
    assert open_cache_file(good).prefix_ids[:1] == [1]
    assert cli("inspect-cache", good).exit_code == 0


@pytest.mark.parametrize("edit,message", [
    (None, "the cache is for llama with 5 layers; this model is llama with 3 layers"),
    ("tokenizer", "different tokenizer"),
    ("config", "different model config"),
])
def test_cache_for_another_model_is_refused(good, tmp_path, tiny_models, default_model_dir, edit, message):
    model = tiny_models("llama")
    if edit is not None:
        model = tmp_path / "model"
        shutil.copytree(default_model_dir, model)
        if edit == "tokenizer":
            tok = json.loads((model / "tokenizer.json").read_text())
            vocab = tok["model"]["vocab"]
            a, b = "▁Once", "▁upon"
            vocab[a], vocab[b] = vocab[b], vocab[a]
            (model / "tokenizer.json").write_text(json.dumps(tok))
        else:
            cfg = json.loads((model / "config.json").read_text())
            cfg["rms_norm_eps"] *= 2
            (model / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out.kv"
    _one_line_error(cli("generate", "-m", model, "-p", "x", "--load-cache", good, "--save-cache", out), message)
    assert not out.exists()


def _reweighted(default_model_dir, out, change):
    shutil.copytree(default_model_dir, out)
    weights = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(str(out / "model.safetensors"), {k: change(k, v) for k, v in weights.items()})
    return out


def test_a_cache_from_other_weights_of_the_same_architecture_is_refused(good, tmp_path, default_model_dir):
    """Same config and vocabulary, weights moved as a fine-tune moves them (a few percent): refused by
    name; the same weights converted to bfloat16 (rounding up to 0.4%) still continue the cache."""
    mx.random.seed(0)
    tuned = _reweighted(default_model_dir, tmp_path / "tuned",
                        lambda k, v: v * (1 + 0.05 * mx.random.normal(v.shape)) if v.ndim == 2 else v)
    out = tmp_path / "out.kv"
    _one_line_error(cli("generate", "-m", tuned, "-p", "x", "--load-cache", good, "--save-cache", out),
                    "other weights of this architecture")
    assert not out.exists()
    bf16 = _reweighted(default_model_dir, tmp_path / "bf16", lambda k, v: v.astype(mx.bfloat16))
    r = cli("generate", "-m", bf16, "-p", " She", "-n", "3", "--load-cache", good)
    assert r.exit_code == 0, r.output


def test_volatile_config_keys_do_not_matter(good, tmp_path, default_model_dir):
    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(transformers_version="9.9.9", _name_or_path="/somewhere/else", torch_dtype="bfloat16")
    (model / "config.json").write_text(json.dumps(cfg))
    r = cli("generate", "-m", model, "-p", " She", "-n", "3", "--load-cache", good)
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_interrupted_save_leaves_the_old_file(tmp_path, failure):
    out = tmp_path / "c.kv"
    out.write_bytes(b"old")

    def write(f):
        f.write(b"partial")
        raise failure

    with pytest.raises(MlxkvError if isinstance(failure, OSError) else KeyboardInterrupt):
        atomic_write(out, write)
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["c.kv"]


def test_save_target_checked_before_the_run(tmp_path):
    _one_line_error(cli("generate", "-p", "x", "--save-cache", tmp_path), "is a directory")
    _one_line_error(cli("generate", "-p", "x", "--save-cache", tmp_path / "no" / "c.kv"), "does not exist")
    _one_line_error(cli("generate", "-p", "x", "-p", "y", "--save-cache", tmp_path / "c.kv"), "exactly one prompt")


def test_chat_continue_needs_a_loaded_cache():
    _one_line_error(cli("generate", "-p", "x", "--chat-continue"), "--chat-continue")
