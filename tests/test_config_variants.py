"""One type per variant (config/base.py `Variant`): engine.backend, rl.mode, rl.curriculum.mode
and rl.judge choose a type holding only their own keys; a key of another variant is one line
naming the key, its value and the choice it applies with; every config file we ship loads."""

from functools import partial
from pathlib import Path

import pytest

from tiller.config import (
    AsyncRLConfig,
    Config,
    ConfigError,
    CurriculumConfig,
    DifficultyCurriculumConfig,
    EmbeddedEngineConfig,
    EngineConfig,
    FilterCurriculumConfig,
    FnJudgeConfig,
    HttpEngineConfig,
    JudgeConfig,
    ModelJudgeConfig,
    NoJudgeConfig,
    OneStepOffRLConfig,
    RLConfig,
    SyncRLConfig,
    load_config,
)
from tiller.config.engine import CPU_SETS, TILLER_SETS, refused_flag
from tiller.engine.follower import run_api_key
from tiller.engine.vllm_launch import managed_flags, server_specs

ROOT = Path(__file__).parent.parent
CONFIG = ROOT / "configs" / "calculator.yaml"
HTTP = ["engine.backend=http", 'engine.urls=["http://127.0.0.1:30000"]']
VLLM_URLS = ["engine.backend=vllm", 'engine.urls=["http://127.0.0.1:30000"]']


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in [
    *ROOT.glob("configs/**/*.yaml"), *ROOT.glob("examples/**/*.yaml")]))
def test_every_shipped_config_loads_and_round_trips(path):
    cfg = load_config(ROOT / path)
    assert Config.model_validate(cfg.model_dump()) == cfg


def test_shipped_configs_are_found():
    assert len(list(ROOT.glob("configs/**/*.yaml"))) >= 8
    assert len(list(ROOT.glob("examples/**/*.yaml"))) >= 2


@pytest.mark.parametrize("overrides, section, variant", [
    ([], "engine", EmbeddedEngineConfig),
    (HTTP, "engine", HttpEngineConfig),
    ([], "rl", SyncRLConfig),
    (["rl.mode=one_step_off"], "rl", OneStepOffRLConfig),
    (["rl.mode=async", "rl.max_staleness=2"], "rl", AsyncRLConfig),
    ([], "rl.curriculum", DifficultyCurriculumConfig),
    (["rl.curriculum.mode=filter", "rl.curriculum.pool=8"], "rl.curriculum",
     FilterCurriculumConfig),
    ([], "rl.judge", NoJudgeConfig),
    (["rl.judge.fn=tiller.train.judges:grounded_answer"], "rl.judge", FnJudgeConfig),
    (["rl.judge.model=/m", "rl.judge.weight=0.2"], "rl.judge", ModelJudgeConfig),
])
def test_the_choice_picks_the_type_and_it_round_trips(overrides, section, variant):
    cfg = load_config(CONFIG, overrides)
    node = cfg
    for key in section.split("."):
        node = getattr(node, key)
    assert type(node) is variant
    assert Config.model_validate(cfg.model_dump()) == cfg


@pytest.mark.parametrize("overrides, message", [
    ([*HTTP, "engine.cache_bytes=0"], "config field engine.cache_bytes: got 0; it only applies "
     "with engine.backend: embedded (engine.backend is http): leave it out, or drop it with "
     "engine.cache_bytes=null"),
    # before the split the embedded engine silently ignored these two
    (["engine.request_timeout_s=5"], "config field engine.request_timeout_s: got 5; it only "
     "applies with engine.backend: http or engine.backend: vllm or engine.backend: sglang "
     "(engine.backend is embedded): leave it out, or drop it with engine.request_timeout_s=null"),
    (["engine.max_retries=0"], "config field engine.max_retries: got 0; it only applies with "
     "engine.backend: http or engine.backend: vllm or engine.backend: sglang (engine.backend is "
     "embedded): leave it out, or drop it with engine.max_retries=null"),
    (["rl.mode=one_step_off", "rl.max_staleness=1"], "config field rl.max_staleness: got 1; it "
     "only applies with rl.mode: async (rl.mode is one_step_off): leave it out, or drop it with "
     "rl.max_staleness=null"),
    (["rl.curriculum.mode=filter", "rl.curriculum.min_level=1"], "config field "
     "rl.curriculum.min_level: got 1; it only applies with rl.curriculum.mode: difficulty "
     "(rl.curriculum.mode is filter): leave it out, or drop it with "
     "rl.curriculum.min_level=null"),
    (["rl.judge.fn=tiller.train.judges:grounded_answer", "rl.judge.prompt='{answer}'"],
     "config field rl.judge.prompt: got '{answer}'; it only applies with rl.judge.model: leave it "
     "out, or drop it with rl.judge.prompt=null"),
    (["rl.judge.margin=0.2"], "config field rl.judge.margin: got 0.2; it only applies with "
     "rl.judge.fn or rl.judge.model: leave it out, or drop it with rl.judge.margin=null"),
    (["engine.backend=trt"], "config field engine.backend: got 'trt'; expected one of: "
     "embedded, http, vllm, sglang"),
    # vLLM reloads full checkpoints: a delta mode fails here, not at the first push
    (["engine.backend=vllm", "weight_sync.mode=delta"], "config field weight_sync.mode: got "
     "delta; engine.backend vllm loads full checkpoints only: set full"),
    (["rl.mode=later"], "config field rl.mode: got 'later'; expected one of: sync, "
     "one_step_off, async"),
    # vLLM reports logprobs of the truncated distribution (processed_logprobs)
    (["engine.backend=vllm", "sampling.top_p=0.9", "sampling.logprobs=untruncated"],
     "config field sampling.logprobs: got 'untruncated'; vLLM (--logprobs-mode "
     "processed_logprobs) reports logprobs of the distribution after top-k / top-p: set "
     "sampling.logprobs: sampled"),
    # fields only servers tiller starts use, set with engine.urls (attached): refused
    *[([*VLLM_URLS, f"engine.{key}={value}"], f"config field engine.{key}: got {shown}; it "
       "only applies to servers tiller starts, and engine.urls lists servers to attach to "
       "(leave it out)")
      for key, value, shown in [("servers", 2, 2), ("python", "/x/python", "/x/python"),
                                ("kv_cache_bytes", 1 << 30, 1 << 30), ("threads", 4, 4),
                                ("extra_args", "[--max-num-seqs,8]", ['--max-num-seqs', '8']),
                                ("startup_timeout_s", 9, 9.0)]],
    ([*HTTP, "engine.startup_timeout_s=9"], "config field engine.startup_timeout_s: got 9.0; "
     "it only applies to servers tiller starts, and engine.urls lists servers to attach to "
     "(leave it out)"),
    (["engine.backend=sglang", 'engine.urls=["http://127.0.0.1:30000"]',
      "engine.startup_timeout_s=9"], "config field engine.startup_timeout_s: got 9.0; it only "
     "applies to servers tiller starts, and engine.urls lists servers to attach to (leave it "
     "out)"),
    # arguments tiller sets itself: the last one given would win (argparse), rebinding it
    *[(["engine.backend=vllm", f"engine.extra_args=[{arg}]"], "config field engine.extra_args: "
       f"got {arg.split(',')[0]!r}, which would rebind {flag}; tiller sets --model, "
       "--served-model-name, --host, --port, --dtype, --max-model-len, "
       "--kv-cache-memory-bytes, --logprobs-mode, --weight-transfer-config itself (the last "
       "one given would win) and --config could set them: use the engine fields")
      for arg, flag in [("--host=0.0.0.0", "--host"), ("--served_model_name,x",
                                                       "--served-model-name"),
                        ("--hos,0.0.0.0", "--host"), ("--config,c.yaml", "--config")]],
])
def test_a_key_of_another_variant_is_one_line_naming_it(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, overrides)
    assert str(e.value) == message


def test_weights_dir_under_shm_is_refused_naming_both_fields() -> None:
    """Under shm a push writes no file: engine.weights_dir would do nothing (review s9-i21 F8)."""
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, ["engine.backend=vllm", "engine.weight_transfer=shm",
                             "engine.weights_dir=/dev/shm/w"])
    assert str(e.value) == ("config field engine.weights_dir: got '/dev/shm/w'; "
                            "engine.weight_transfer is shm, whose pushes go through one /dev/shm "
                            "segment, not a folder: leave engine.weights_dir out")
    assert load_config(CONFIG, ["engine.backend=vllm", "engine.weights_dir=/dev/shm/w"]
                       ).engine.weights_dir == "/dev/shm/w"  # disk: it is where pushes go


@pytest.mark.parametrize("cpu", [True, False])
def test_the_cpu_only_flags_are_sent_to_cpu_servers_only(cpu: bool) -> None:
    """--enforce-eager and --no-enable-chunked-prefill are for vLLM's CPU build; on a CUDA
    build they would turn off CUDA graphs and chunked prefill (review s9-i21 F2)."""
    argv = server_specs("py", Path("m"), 1, max_context=8, dtype="float32", kv_cache_bytes=1,
                        threads=1, extra_args=["--max-num-seqs", "8"], cpu=cpu)[0].argv
    assert argv == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
                    "--served-model-name", "tiller", "--host", "127.0.0.1", "--port", "{port}",
                    "--dtype", "float32", "--max-model-len", "8", "--kv-cache-memory-bytes",
                    "1", "--logprobs-mode", "processed_logprobs",
                    *(["--enforce-eager", "--no-enable-chunked-prefill"] if cpu else []),
                    "--max-num-seqs", "8"]
    assert CPU_SETS == ("--enforce-eager", "--no-enable-chunked-prefill")


def forms(flag: str) -> tuple[str, ...]:
    bare = flag.removeprefix("--").removeprefix("no-")
    return f"--{bare}", f"--no-{bare}", f"--{bare}=x"


def test_every_flag_of_the_managed_argv_is_refused_in_extra_args_in_both_forms():
    """TILLER_SETS at config time on every build; CPU_SETS only where tiller sets them, on
    vLLM's CPU build (at start-up, once the platform is known): a CUDA user may turn eager
    mode on or chunked prefill off (review s9 F5)."""
    flags = managed_flags()  # from server_specs' own argv (CPU, shm: the most flags)
    assert set(flags) == set(TILLER_SETS) | set(CPU_SETS)  # the lists the errors name
    for flag in TILLER_SETS:
        for form in forms(flag):
            with pytest.raises(ConfigError, match=f"^config field engine.extra_args: got "
                               f"'{form}', which would rebind {flag}; "):
                load_config(CONFIG, ["engine.backend=vllm", f"engine.extra_args=[{form}]"])
    specs = partial(server_specs, "py", Path("m"), 1, max_context=8, dtype="float32",
                    kv_cache_bytes=1, threads=1)
    for flag in CPU_SETS:
        for form in (*forms(flag), "--enable-chunked-prefill", "--no-enforce-eager"):
            extra = load_config(CONFIG, ["engine.backend=vllm", f"engine.extra_args=[{form}]"]
                                ).engine.extra_args
            assert specs(extra_args=extra, cpu=False)[0].argv[-1] == form  # CUDA: theirs
            with pytest.raises(ConfigError) as e:
                specs(extra_args=extra, cpu=True)
            assert str(e.value) == (
                f"config field engine.extra_args: got '{form}', which would rebind "
                f"{refused_flag(form, CPU_SETS)}; tiller sets --enforce-eager and "
                "--no-enable-chunked-prefill itself on vLLM's CPU build, which py runs (a CUDA "
                "build leaves both to engine.extra_args): leave it out")
    assert refused_flag("--no-enforce-eager", CPU_SETS) == "--enforce-eager"
    assert refused_flag("--enable-chunked-prefill", CPU_SETS) == "--no-enable-chunked-prefill"


def test_vllm_extra_args_take_numbers_and_attached_defaults_load():
    cfg = load_config(CONFIG, ["engine.backend=vllm", "engine.extra_args=[--max-num-seqs,8]"])
    assert cfg.engine.extra_args == ["--max-num-seqs", "8"]
    attached = load_config(CONFIG, [*VLLM_URLS, "engine.servers=1", "engine.threads=1"])
    assert attached.engine.urls == ["http://127.0.0.1:30000"]  # the defaults say nothing
    assert Config.model_validate(attached.model_dump()) == attached


def test_errors_inside_a_variant_name_the_key_not_the_variant():
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [*HTTP, "engine.max_retries=-1"])
    assert str(e.value).startswith("config field engine.max_retries: got -1; ")
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, ["rl.curriculum.mode=filter", "rl.curriculum.pool=0"])
    assert str(e.value).startswith("config field rl.curriculum.pool: got 0; ")


def test_configs_saved_before_the_split_still_load():
    """A run folder's config.yaml from before the split holds every key of each section, the
    other variants' at their defaults (or null): they say nothing, and are dropped."""
    saved = load_config(CONFIG).model_dump()
    saved["engine"].update(urls=[], api_key=None, weights_dir=None, request_timeout_s=300.0,
                           max_retries=2)
    saved["rl"].update(max_staleness=None)
    saved["rl"]["curriculum"].update(pool=None, max_skips=None)
    saved["rl"]["judge"] = {"fn": None, "model": None, "prompt": ModelJudgeConfig.model_fields[
        "prompt"].default, "weight": 0.1, "window": 3, "margin": 0.05}
    assert Config.model_validate(saved) == load_config(CONFIG)
    http = load_config(CONFIG, HTTP).model_dump()
    http["engine"].update(max_batch_size=128, cache_bytes=1 << 30)
    assert Config.model_validate(http) == load_config(CONFIG, HTTP)


@pytest.mark.parametrize("build, message", [
    (lambda: RLConfig(mode="async"),
     "RLConfig has no field mode; use AsyncRLConfig(...), or load a YAML"),
    (lambda: EngineConfig(backend="http"),
     "EngineConfig has no field backend; use HttpEngineConfig(...), or load a YAML"),
    (lambda: CurriculumConfig(mode="filter"),
     "CurriculumConfig has no field mode; use FilterCurriculumConfig(...), or load a YAML"),
    (lambda: RLConfig(steps=3, max_staleness=2),  # a key only one variant has
     "RLConfig has no field max_staleness; use AsyncRLConfig(...), or load a YAML"),
    (lambda: EngineConfig(urls=["http://127.0.0.1:1"]),
     "EngineConfig has no field urls; use HttpEngineConfig(...) or VllmEngineConfig(...) or "
     "SglangEngineConfig(...), or "
     "load a YAML"),
    (lambda: JudgeConfig(model="m"),
     "JudgeConfig has no field model; use ModelJudgeConfig(...), or load a YAML"),
    (lambda: RLConfig(mode="later"),  # no variant is chosen by it: every one that has the key
     "RLConfig has no field mode; use SyncRLConfig(...) or OneStepOffRLConfig(...) or "
     "AsyncRLConfig(...), or load a YAML"),
])
def test_a_base_given_a_variants_key_names_the_variant_class(build, message):
    with pytest.raises(ConfigError) as e:
        build()
    assert str(e.value) == message
    assert RLConfig(steps=3).steps == 3  # the keys every variant has stay the base's


def test_the_python_api_takes_variant_instances():
    cfg = load_config(CONFIG)
    cfg.engine = HttpEngineConfig(urls=["http://127.0.0.1:1"])  # validated on assignment
    assert type(cfg.engine) is HttpEngineConfig
    assert Config.model_validate(cfg.model_dump()).engine.urls == ["http://127.0.0.1:1"]
    assert AsyncRLConfig(max_staleness=3).algorithm.off_policy == "mis"  # stale: corrected
    assert SyncRLConfig().algorithm.off_policy == "none"


def test_the_vllm_api_key_is_hidden_in_dumps_and_handed_to_followers(monkeypatch):
    monkeypatch.delenv("TILLER_API_KEY", raising=False)
    cfg = load_config(CONFIG, ["engine.backend=vllm", "engine.api_key=s7-key-0123456789"])
    assert cfg.engine.model_dump()["api_key"] == "**********"
    assert run_api_key(cfg).get_secret_value() == "s7-key-0123456789"  # Ray workers send it
    monkeypatch.setenv("TILLER_API_KEY", "from-the-env-012345")
    assert run_api_key(load_config(CONFIG, ["engine.backend=vllm"])).get_secret_value() == (
        "from-the-env-012345")
