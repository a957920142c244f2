"""Bad inputs of issue 60 (the fourth round), one test per class: each refused in one line (exit 2) that
names the flag or key and says what to do, before any work or weights: a --set value that is not YAML,
an output folder of demo / demo --rl / fidelity that cannot be written, a list that names a run twice,
0 given for a flag, a section given as null, eval --precision recipe's refusals and an fp8.backend that
cannot run the recipe, removed flags and a config of the other stage, flags of another mode or format;
and a study that fails part way says what it kept and writes no results file of a part."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import transformers
import yaml

import infir2.export
from conftest import make_tiny_model, make_tokenizer
from infir2.cli import main
from infir2.harness.typed_yaml import apply_overrides
from infir2.rl import parse_rl_config
from infir2.tools.recipe_spec import check_tail
from train_synthetic import one_thread, tiny_cpt_sections, tiny_rl_sections

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _refused(capsys, argv: list[str], *needles: str) -> str:
    """``infir2 argv`` exits 2 with one stderr line (log records aside) holding every needle."""
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and " WARNING " not in ln and " INFO " not in ln]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


@pytest.fixture
def no_work(monkeypatch):
    """Training anything or reading a model's weights fails the test: a refusal must come before."""

    def fail(*args, **kwargs):
        raise AssertionError("work started before the refusal")

    import infir2.tools.bench.fidelity as fidelity
    import infir2.tools.demo.command as demo
    import infir2.tools.demo.rl as demo_rl

    monkeypatch.setattr(demo, "run_demo", fail)
    monkeypatch.setattr(demo, "data_only", fail)
    monkeypatch.setattr(demo_rl, "run_rl_study", fail)
    monkeypatch.setattr(fidelity, "run_ladder", fail)
    monkeypatch.setattr(infir2.export, "load_checkpoint", fail)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)


@pytest.fixture
def configs(tmp_path):
    """A CPT config and an RL config of tiny fixtures, as YAML files."""
    model = tmp_path / "model"
    make_tiny_model(hidden=64, layers=1, seed=1).save_pretrained(model)
    make_tokenizer().save_pretrained(model)
    train, rl = tiny_cpt_sections(tmp_path), tiny_rl_sections(tmp_path, model)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(train))
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(rl))
    return tmp_path, train, rl


# ----------------------------------------------------------------------------- 1. a --set value that is not YAML


@pytest.mark.parametrize("value", ["{", "[0.9,", '"unclosed', "@home", "a: b: c", "*alias"])
@pytest.mark.parametrize("command", ["train", "rl", "config"])
def test_a_set_value_that_is_not_yaml_is_one_line_naming_its_key(configs, capsys, command, value):
    root, _, _ = configs
    config = root / ("rl.yaml" if command == "rl" else "train.yaml")
    argv = [command, str(config), "--set", f"run.name={value}"]
    line = _refused(
        capsys, argv if command == "config" else [*argv, "--no-progress"], "run.name", "not valid YAML"
    )
    assert "quote a string" in line
    # the advice's own spelling parses, to the text that was meant (was a yaml ParserError traceback)
    quoted = line.rsplit("quote a string: ", 1)[1]
    assert apply_overrides({}, [quoted])["run"]["name"] == value
    assert not (root / "runs").exists()


# ----------------------------------------------------------------------------- 2. output folders, before any work


def _bad_outs(tmp_path: Path) -> list[tuple[Path, str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    outs = [(a_file, "is a file"), (a_file / "new", "is a file")]
    if os.geteuid() != 0:  # chmod does not bind root
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        outs += [(ro, "not writable"), (ro / "new", "not writable")]
    if Path("/sys/kernel").is_dir():  # sysfs refuses a new folder even to root, whom access() says may
        outs += [(Path("/sys/infir2-test-out/x"), "cannot create /sys/infir2-test-out")]
    return outs


@pytest.mark.parametrize(
    "argv",
    [["demo", "--quick"], ["demo", "--quick", "--rl"], ["demo", "--data-only"], ["fidelity", "--quick"]],
)
def test_an_output_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, no_work, argv):
    for out, why in _bad_outs(tmp_path):
        _refused(capsys, [*argv, "--out", str(out)], "--out", why, "choose another --out")
        assert not (tmp_path / "ro" / "new").exists()


# ----------------------------------------------------------------------------- 3. a list that names a run twice


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["demo", "--quick", "--recipes", "bf16,blockwise,blockwise"],
            "--recipes: recipe blockwise given twice",
        ),
        (
            ["demo", "--quick", "--recipes", "bf16, nvfp4+tail ,nvfp4+tail"],
            "--recipes: recipe nvfp4+tail given twice",
        ),
        (["demo", "--quick", "--rl", "--seeds", "3,3"], "--seeds"),
        (
            ["fidelity", "--quick", "--recipes", "bf16,blockwise,blockwise"],
            "--recipes: recipe blockwise given twice",
        ),
        (["fidelity", "--quick", "--widths", "128,128"], "--widths: width 128 given twice"),
        (["fidelity", "--quick", "--seeds", "0,1,0"], "--seeds: seed 0 given twice"),
        (["memory", "--models", "1.5B,1.5B"], "--models: model 1.5B given twice"),
        (
            ["memory", "--models", "1.5B", "--recipes", "blockwise,blockwise"],
            "--recipes: recipe blockwise given",
        ),
        (
            ["bench", "--device", "cpu", "--recipes", "blockwise,blockwise"],
            "--recipes: recipe blockwise given",
        ),
        (
            ["bench", "--device", "cpu", "--sections", "quantize,quantize"],
            "--sections: section quantize given",
        ),
        (
            ["bench", "--device", "cpu", "--backends", "emulated,emulated"],
            "--backends: backend emulated given",
        ),
    ],
)
def test_a_list_that_names_a_run_twice_is_refused(tmp_path, capsys, no_work, argv, needle):
    """Two workers in one run folder, or each seed counted twice in a verdict's interval, was the result."""
    _refused(
        capsys, [*argv, "--out", str(tmp_path / "o")] if argv[0] in ("demo", "fidelity") else argv, needle
    )
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- 4. zero is a value given


@pytest.mark.parametrize(
    "flag",
    [
        "--tensor-parallel-size",
        "--memory-fraction",
        "--cpu-kv-cache-gib",
        "--max-model-len",
        "--concurrency",
        "--retries",
        "--request-timeout",
        "--samples-per-request",
    ],
)
def test_zero_for_another_engines_flag_is_a_flag_given(configs, capsys, no_work, flag):
    """``0 in (None, False)`` is true in Python: a 0 passed the other-engine check and ran."""
    root, _, _ = configs
    argv = ["eval", "--model", str(root / "model"), "--out", str(root / "o"), flag, "0"]
    _refused(capsys, argv, flag, "not of --engine builtin")


@pytest.mark.parametrize(
    "argv",
    [
        ["fidelity", "--quick", "--steps", "0"],
        ["fidelity", "--quick", "--layers", "0"],
        ["bench", "--layers", "0"],
    ],
)
def test_zero_for_a_count_is_refused_not_the_presets(tmp_path, capsys, no_work, argv):
    flag = argv[-2]
    extra = ["--out", str(tmp_path / "o")] if argv[0] == "fidelity" else ["--device", "cpu"]
    _refused(capsys, [*argv, *extra], f"{flag}: must be", "got 0")


# ----------------------------------------------------------------------------- 5. null, one meaning


@pytest.mark.parametrize(
    ("stage", "section"), [("rl", "guard"), ("rl", "rollout"), ("train", "optim"), ("train", "fp8")]
)
def test_a_section_given_as_null_is_refused_a_key_null_is_off(configs, capsys, stage, section):
    """``guard: null`` left the guard on at its defaults while ``guard.max_kl: null`` turns that alarm off."""
    root, train, rl = configs
    cfg = {**(rl if stage == "rl" else train), section: None}
    f = root / f"{section}-null.yaml"
    f.write_text(yaml.safe_dump(cfg))
    line = _refused(
        capsys, [stage, str(f), "--no-progress"], f"{section}: is null", "leave it out for its defaults"
    )
    config = root / ("rl.yaml" if stage == "rl" else "train.yaml")
    assert _refused(
        capsys, [stage, str(config), "--no-progress", "--set", f"{section}=null"], f"{section}: is null"
    )
    if section == "guard":
        assert "guard.max_val_drop: null" in line  # the key whose null is "off"
        assert parse_rl_config({**rl, "guard": {"max_val_drop": None}}).guard.max_val_drop is None
        assert parse_rl_config({k: v for k, v in rl.items() if k != "guard"}).guard.max_val_drop == 0.05


# ----------------------------------------------------------------------------- 6. refusals before any weights


@pytest.fixture
def moe_dir(tmp_path):
    """A tiny Qwen3-MoE folder (routed experts: FP8 recipes run them, NVFP4 does not)."""
    from moe_models import moe_config

    config = moe_config("qwen3_moe")
    config.vocab_size = 300
    folder = tmp_path / "moe"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def test_refusals_known_before_the_weights_come_before_them(configs, moe_dir, capsys, monkeypatch):
    root, _, _ = configs
    model, tokens = root / "model", root / "cpt"
    # a rerun of another --recipe (docs/EVAL_EXPORT.md: before any weights); its first run reads them
    base = ["eval", "--model", str(model), "--limit", "1", "--greedy", "--max-new-tokens", "4"]
    out = root / "rerun"
    assert main([*base, "--precision", "recipe", "--recipe", "blockwise", "--out", str(out)]) == 0
    assert main([*base, "--precision", "recipe", "--recipe", "blockwise", "--out", str(out)]) == 0  # resumes
    monkeypatch.setattr(infir2.export, "load_checkpoint", _fail)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _fail)
    _refused(
        capsys,
        [*base, "--precision", "recipe", "--recipe", "tensorwise", "--out", str(out)],
        "recipe (blockwise)",
    )
    _refused(capsys, [*base, "--out", str(out)], "recipe (blockwise)")  # the same folder at --precision high
    ppl = ["eval", "--model", str(model), "--perplexity", str(tokens), "--seq-len", "16"]
    for argv in ([*base, "--out", str(root / "o")], [*ppl, "--out", str(root / "p")]):  # both eval paths
        precision = [*argv, "--precision", "recipe"]
        _refused(capsys, [*precision, "--recipe", "blockwise,tensorwise"], "--recipe takes one recipe")
        _refused(
            capsys, [*precision, "--recipe", "bf16"], "--recipe bf16 has no FP8 layers", "--precision high"
        )
        _refused(capsys, [*precision, "--recipe", "fp4"], "--recipe: unknown FP8 recipe 'fp4'")
        moe = [*precision, "--recipe", "nvfp4"]
        moe[moe.index("--model") + 1] = str(moe_dir)
        line = _refused(capsys, moe, "--recipe: nvfp4 cannot run", "routed experts")
        assert "module_filter_fn" not in line  # advice to a CLI user names no Python argument
    for stage, sets in (
        ("train", ["model.from_config=null", f"model.path={moe_dir}", "fp8.recipe=nvfp4"]),
        ("rl", [f"model.path={moe_dir}", "fp8.recipe=nvfp4"]),
        ("train", ["fp8.recipe=tensorwise", "fp8.backend=triton"]),
        ("rl", ["fp8.recipe=nvfp4", "fp8.backend=fast_emulated"]),
    ):
        argv = [stage, str(root / f"{stage}.yaml"), "--no-progress", *(x for s in sets for x in ("--set", s))]
        key = "fp8.backend" if "backend" in sets[-1] else "fp8.recipe"
        _refused(capsys, argv, f"{key}: ")
    assert not (root / "runs").exists()


def _fail(*args, **kwargs):
    raise AssertionError("weights were read before the refusal")


# ----------------------------------------------------------------------------- 7. what to do, not only what is wrong


def test_refusals_say_what_to_do(configs, capsys, no_work, tmp_path):
    root, _, _ = configs
    # the removed --fp8: argparse said "unrecognized arguments"
    _refused(
        capsys, ["eval", "--model", str(root / "model"), "--fp8"], "--precision fp8", "--precision recipe"
    )
    _refused(capsys, ["train", str(root / "train.yaml"), "--fp8", "blockwise"], "--set fp8.recipe=blockwise")
    _refused(capsys, ["rl", str(root / "rl.yaml"), "--fp8=blockwise"], "rollout.precision")
    # a config of the other stage: "data.global_batch_size: unknown key" before
    _refused(
        capsys,
        ["rl", str(root / "train.yaml"), "--no-progress"],
        "data.train_path: a key of",
        "run this config with `infir2 train`",
    )
    _refused(
        capsys,
        ["train", str(root / "rl.yaml"), "--no-progress"],
        "rollout: a key of",
        "run this config with `infir2 rl`",
    )
    # a +tail that takes every block: refused after the baseline trained, saying only "no layer to convert"
    out = str(tmp_path / "o")
    _refused(
        capsys, ["demo", "--quick", "--recipes", "bf16,nvfp4+tail", "--out", out], "use nvfp4 without +tail"
    )
    _refused(
        capsys, ["fidelity", "--quick", "--recipes", "nvfp4+tail", "--out", out], "use nvfp4 without +tail"
    )
    tail = ["--set", "fp8.recipe=nvfp4", "--set", "fp8.high_precision_tail=0.5"]  # the config's tail, 1 block
    _refused(
        capsys,
        ["train", str(root / "train.yaml"), "--no-progress", *tail],
        "fp8.high_precision_tail",
        "lower it",
    )
    with pytest.raises(ValueError, match="keeps the last 1 of the 1 decoder block"):
        check_tail(["nvfp4+tail"], 1, "--recipes", "m")  # ceil(0.15 x 1) = 1: every block
    for blocks in (2, 4, 7):  # ceil(0.15 x n) < n: some blocks left in low precision
        check_tail(["nvfp4+tail"], blocks, "--recipes", "m")
    check_tail(["nvfp4"], 1, "--recipes", "m")  # no tail, nothing kept


# ----------------------------------------------------------------------------- 8. flags of another mode or format


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--split", "train"], "--split sets the held-out loss of --perplexity"),
        (["--seq-len", "32"], "--seq-len sets the held-out loss"),
        (["--max-windows", "2"], "--max-windows sets the held-out loss"),
        (["PPL", "--n", "4"], "--n sets how a benchmark is run"),
        (["PPL", "--greedy"], "--greedy sets how a benchmark is run"),
        (["PPL", "--data", "x.jsonl"], "--data sets how a benchmark is run"),
        (["PPL", "--tokenizer", "tok"], "--tokenizer sets how a benchmark is run"),
    ],
)
def test_an_eval_flag_of_the_other_mode_is_refused(configs, capsys, no_work, extra, needle):
    root, _, _ = configs
    argv = ["eval", "--model", str(root / "model"), "--out", str(root / "o")]
    if extra[0] == "PPL":
        extra = ["--perplexity", str(root / "cpt"), *extra[1:]]
    _refused(capsys, [*argv, *extra], needle)
    assert not (root / "o").exists()


def test_a_flag_that_would_be_ignored_is_refused(configs, capsys, no_work, tmp_path):
    root, _, _ = configs
    out = str(tmp_path / "o")
    _refused(capsys, ["config", str(root / "rl.yaml"), "--world-size", "4"], "--world-size", "RL config")
    _refused(capsys, ["config", "--keys", "--set", "optim.lr=1"], "--set goes with a config to check")
    _refused(capsys, ["config", "--list", "--world-size", "2"], "--world-size goes with a config")
    for mode in (["--report-only"], ["--update-readme", "README.md"], ["--data-only"]):
        for flag in (["--seeds", "0,1"], ["--recipes", "bf16"], ["--jobs", "2"]):
            _refused(
                capsys, ["demo", *mode, *flag, "--out", out], f"{flag[0]} sets the runs", f"drop {flag[0]}"
            )
    _refused(capsys, ["demo", "--report-only", "--quick", "--out", out], "--quick sets the runs")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize(
    "flag", [["--scale-encoding", "fp32"], ["--base-dtype", "fp32"], ["--whole-blocks-only"]]
)
def test_an_export_flag_of_fp8_with_another_format_is_refused(configs, capsys, no_work, fmt, flag):
    root, _, _ = configs
    out = root / "export"
    _refused(
        capsys, ["export", "--model", str(root / "model"), "--out", str(out), "--format", fmt, *flag], flag[0]
    )
    assert not out.exists()


# ----------------------------------------------------------------------------- 9. a study that fails part way


def test_a_fidelity_ladder_that_fails_part_way_says_what_it_kept(tmp_path, capsys, monkeypatch):
    """The runs finished are kept and named, no fidelity.json is written from them, the rerun goes on."""
    import infir2.tools.bench.fidelity as fidelity

    calls = []

    def run_one(out, s, width, recipe, seed, tokenizer):
        calls.append((width, recipe, seed))
        if len(calls) == 3:
            raise ValueError("fp8.recipe: the third run failed")
        return object()

    monkeypatch.setattr(fidelity, "prepare", lambda out, s: (None, {}))
    monkeypatch.setattr(fidelity, "run_one", run_one)
    settings = fidelity.replace(fidelity.QUICK, seeds=(0, 1))  # 2 recipes x 2 seeds: 4 runs
    with pytest.raises(ValueError) as e:
        fidelity.run_ladder(tmp_path / "f", settings)
    assert "the third run failed (2 of 4 runs finished and kept" in str(e.value)
    assert "the same command again trains only the rest" in str(e.value)
    assert not (tmp_path / "f" / "fidelity.json").exists()


def test_a_demo_that_fails_part_way_says_what_it_kept(tmp_path, monkeypatch):
    import infir2.tools.demo.pipeline as pipeline

    done = []

    def run_recipe(recipe, seed, *args, **kwargs):
        if len(done) == 1:
            raise ValueError("a run failed")
        done.append((recipe, seed))
        return object()

    monkeypatch.setattr(pipeline, "prepare_data", lambda out, s: ({}, None))
    monkeypatch.setattr(pipeline, "run_recipe", run_recipe)
    with pytest.raises(ValueError) as e:
        pipeline.run_demo(tmp_path / "d", pipeline.QUICK, ["bf16", "blockwise"], jobs=1)
    assert "a run failed (1 of 4 runs had finished in" in str(e.value)
    assert "starts the demo over" in str(e.value)
    assert not (tmp_path / "d" / "results.json").exists()


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_size": 128}, "lm_head.weight is [300, 64] in the files, [300, 128] by config.json"),
        ({"intermediate_size": 64}, "mlp.down_proj.weight is [64, 256] in the files, [64, 64]"),
        ({"num_hidden_layers": 2, "layer_types": None}, "it names model.layers.1."),
        ({"num_hidden_layers": 2}, "transformers cannot build a model from it"),
    ],
)
def test_an_export_whose_config_disagrees_with_its_tensors_is_refused_before_writing(
    configs, capsys, changes, needle
):
    """The tensors were copied beside a config.json of another size: a folder that does not load."""
    root, _, _ = configs
    model = root / "model"
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    out = root / "export"
    _refused(capsys, ["export", "--model", str(model), "--out", str(out)], "config.json", needle)
    assert not out.exists() and not list(root.glob(".tmp-export-*"))
