import pytest
from helpers import cli

from tiller.config import (
    AlgorithmConfig,
    BuildConfig,
    Config,
    ConfigError,
    OneStepOffRLConfig,
    RLConfig,
    load_config,
)
from tiller.models import build_tiny_model, load_model

CONFIG = "configs/calculator.yaml"


def test_demo_config_validates_and_overrides_apply():
    cfg = load_config(CONFIG, ["rl.steps=3", "sampling.temperature=0.7", "env.name=calculator"])
    assert (cfg.rl.steps, cfg.sampling.temperature) == (3, 0.7)
    assert cfg.model.build is not None and cfg.model.build.hidden_size == 128


@pytest.mark.parametrize(
    "override, words",
    [
        ("rl.group_size=0", ["rl.group_size", "0", "greater than or equal to 1"]),
        ("rl.lr=fast", ["rl.lr", "'fast'", "valid number"]),
        ("rl.algorithm.eps_hgh=0.3", ["rl.algorithm.eps_hgh", "Extra inputs are not permitted"]),
        ("sampling.top_p=1.5", ["sampling.top_p", "1.5", "less than or equal to 1"]),
        ("model.path=/somewhere", ["model", "exactly one of model.path"]),
        ("model.build.head_dim=0", ["model.build.head_dim", "got 0", "even number from 2"]),
        ("model.build.head_dim=15", ["model.build.head_dim", "got 15", "even number from 2"]),
        ("rl.max_idle_steps=5", ["rl.max_idle_steps", "dynamic_sampling.enabled: true"]),
        ("env.tools.executor={tools: {calculate: {cache_scope: run}}}",
         ["env.tools.executor.tools.calculate", "cache_scope only applies with cache: true"]),
    ],
)
def test_bad_fields_name_field_value_and_expectation(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [override])
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("head_dim, expected", [(None, 16), (32, 32)])
def test_build_head_dim_sets_the_width_of_each_head(tmp_path, head_dim, expected):
    build = BuildConfig(hidden_size=128, num_heads=8, head_dim=head_dim)
    out = build_tiny_model(tmp_path / "m", ["1 + 2 = 3", "calculate(4 * 5) -> 20"],
                           vocab_size=300, hidden_size=build.hidden_size, num_layers=1,
                           num_heads=build.num_heads, head_dim=build.head_dim)
    model = load_model(out)
    assert model.config.head_dim == expected
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features) == (8 * expected, 4 * expected)
    assert attn.o_proj.out_features == 128


HTTP = ["engine.backend=http", 'engine.urls=["http://127.0.0.1:30000"]']


def test_the_engine_api_key_stays_out_of_every_dump():
    cfg = load_config(CONFIG, [*HTTP, "engine.api_key=s3cret-key"])
    assert cfg.engine.api_key.get_secret_value() == "s3cret-key"
    dumped = cfg.model_dump()  # what config.yaml and wandb get
    assert dumped["engine"]["api_key"] == "**********"
    assert "s3cret-key" not in str(dumped) + cfg.model_dump_json() + repr(cfg)


@pytest.mark.parametrize("field", ["max_batch_size=64", "cache_bytes=0"])
def test_embedded_engine_fields_with_the_http_backend_are_errors(field):
    with pytest.raises(ConfigError, match=rf"engine.{field.split('=')[0]}: got \d+; it only "
                       r"applies with engine.backend: embedded \(engine.backend is http\)"):
        load_config(CONFIG, [*HTTP, f"engine.{field}"])
    load_config(CONFIG, [*HTTP, "engine.max_batch_size=128"])  # the default: nothing to ignore


def test_unreadable_configs(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad_yaml)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(CONFIG, ["rl.steps"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["rl.steps=-1"], "config field rl.steps: got -1;"),
        (["model.build=null", "model.path=/no/such/model"],
         "no Hugging Face model at '/no/such/model'"),
        (["env.name=chess"], "unknown env 'chess'; choose one of: "),
        (["rl.algorithm.advantage=magic"], "rl.algorithm.advantage: got 'magic'"),
        (["rl.mode=async", "rl.algorithm.off_policy=none"],
         "rl.algorithm.off_policy: got 'none' with rl.mode async, max_staleness 4, whose "
         "samples are stale"),
    ],
)
def test_cli_errors_are_one_line_not_tracebacks(tmp_path, args, message):
    code, out = cli("train", CONFIG, *args, "--output-dir", tmp_path / "run")
    assert code == 2
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_the_cli_output_holds_the_warnings_a_user_sees(tmp_path):
    """`cli` shows what reaches the terminal: a warning logged before the error is a line of
    its own (as `python -m tiller train ...` prints it), so it breaks a one-line assertion."""
    code, out = cli("train", CONFIG, "sampling.top_k=5", "sampling.logprobs=untruncated",
                    "rl.algorithm.off_policy=tis", "agent.loop=nonexistent_mod_xyz:fn",
                    "--output-dir", tmp_path / "run")
    lines = sorted(line for line in out.splitlines() if line.strip())
    assert code == 2 and len(lines) == 2, lines
    assert lines[0].startswith("error: config field agent.loop: got 'nonexistent_mod_xyz:fn'")
    assert lines[1].startswith("sampling.logprobs is untruncated with top_k 5 / top_p 1: "
                               "off_policy tis cannot see the truncation")


@pytest.mark.parametrize("overrides, message", [
    (["env.name=dataset", "data.train=t.jsonl", "rewards=[{verifier: exact_match}]",
      "env.tools=[pkg.mod:tool]"],
     "config field env.tools.functions: got ['pkg.mod:tool']; the dataset env's tools are per "
     "row: list them in data.tools"),
    (["env.name=dataset", "data.train=t.jsonl", "rewards=[{verifier: exact_match}]",
      "agent.program=pkg.mod:main"],
     "config field agent.program: got 'pkg.mod:main'; the dataset env's reward functions score "
     "the conversation its own loop records"),
    (["agent.program=pkg.mod:main", "agent.history=template"],
     "config field agent.history: got 'template'; with agent.program the gateway assembles"),
])
def test_plugin_combinations_that_would_do_nothing_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.build={}", *overrides])
    assert str(e.value).startswith(message), str(e.value)


# ---- issue 19: stale samples get an off-policy correction by default -------------------------

@pytest.mark.parametrize("mode", [["rl.mode=async"], ["rl.mode=one_step_off"],
                                  ["rl.mode=async", "rl.max_staleness=1"]])
def test_stale_modes_default_to_a_correction_and_refuse_none(mode):
    cfg = load_config(CONFIG, mode)
    a = cfg.rl.algorithm  # IcePop's band, docs/async.md
    assert (a.off_policy, a.mis_low, a.mis_high, a.is_cap) == ("mis", 0.5, 5.0, None)
    assert Config.model_validate(cfg.model_dump()) == cfg  # saved resolved, loads back
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [*mode, "rl.algorithm.off_policy=none"])
    assert str(e.value).startswith("config field rl.algorithm.off_policy: got 'none' with "
                                   "rl.mode ")
    assert str(e.value).endswith("or set rl.algorithm.allow_uncorrected_off_policy: true to "
                                 "train them as on-policy") and "\n" not in str(e.value)
    ack = load_config(CONFIG, [*mode, "rl.algorithm.off_policy=none",
                               "rl.algorithm.allow_uncorrected_off_policy=true"])
    assert ack.rl.algorithm.off_policy == "none"
    # a correction the user chose stays, with its own defaults
    tis = load_config(CONFIG, [*mode, "rl.algorithm.off_policy=tis"]).rl.algorithm
    assert (tis.off_policy, tis.is_cap) == ("tis", 2.0)
    # an unset correction's knob is read by the default one
    assert load_config(CONFIG, [*mode, "rl.algorithm.mis_high=3"]).rl.algorithm.mis_high == 3.0


def test_on_policy_modes_keep_no_correction_and_refuse_the_acknowledgement():
    assert load_config(CONFIG).rl.algorithm.off_policy == "none"  # sync stays as it was
    on_policy = load_config(CONFIG, ["rl.mode=async", "rl.max_staleness=0"])
    assert on_policy.rl.algorithm.off_policy == "none"  # async at staleness 0 is sync
    for more in ([], ["rl.mode=async", "rl.max_staleness=0"]):
        with pytest.raises(ConfigError, match=r"config field rl.algorithm."
                           r"allow_uncorrected_off_policy: got True; it only applies where "
                           r"samples can be stale"):
            load_config(CONFIG, [*more, "rl.algorithm.allow_uncorrected_off_policy=true"])
    with pytest.raises(ConfigError, match=r"allow_uncorrected_off_policy: got True; the "
                       r"algorithm ignores it: used only with off_policy: none"):
        load_config(CONFIG, ["rl.mode=async", "rl.algorithm.off_policy=tis",
                             "rl.algorithm.allow_uncorrected_off_policy=true"])
    # built from an AlgorithmConfig instance (the Python API) it resolves the same way
    rl = OneStepOffRLConfig(algorithm=AlgorithmConfig(eps_high=0.3))
    assert (rl.algorithm.off_policy, rl.algorithm.eps_high) == ("mis", 0.3)
    assert RLConfig(algorithm=AlgorithmConfig(eps_high=0.3)).algorithm.off_policy == "none"


def test_sampling_logprobs_needs_truncation():
    assert load_config(CONFIG).sampling.logprobs == "sampled"
    cfg = load_config(CONFIG, ["sampling.top_p=0.9", "sampling.logprobs=untruncated"])
    assert cfg.sampling.logprobs == "untruncated" and cfg.sampling.truncates
    with pytest.raises(ConfigError, match=r"config field sampling.logprobs: got 'untruncated'; "
                       r"it only matters with sampling.top_k > 0 or sampling.top_p < 1"):
        load_config(CONFIG, ["sampling.logprobs=untruncated"])
    with pytest.raises(ConfigError, match=r"sampling.logprobs: got 'raw'; .*'sampled' or "
                       r"'untruncated'"):
        load_config(CONFIG, ["sampling.top_k=5", "sampling.logprobs=raw"])


def test_a_correction_blind_to_truncation_is_one_warning(caplog):
    from tiller.preflight import warn_blind_correction

    blind = load_config(CONFIG, ["sampling.top_k=5", "sampling.logprobs=untruncated",
                                 "rl.mode=async"])
    with caplog.at_level("WARNING", logger="tiller.run"):
        warn_blind_correction(blind)
        warn_blind_correction(load_config(CONFIG, ["sampling.top_k=5", "rl.mode=async"]))
        warn_blind_correction(load_config(CONFIG, ["sampling.top_k=5",
                                                   "sampling.logprobs=untruncated"]))
    [record] = caplog.records  # sampled logprobs, or no correction (sync): nothing to say
    assert record.getMessage().startswith("sampling.logprobs is untruncated with top_k 5 / "
                                          "top_p 1: off_policy mis cannot see the "
                                          "truncation")
    assert "\n" not in record.getMessage()
