"""The vLLM integration's configuration, module by module, without vLLM and without compiling: which
releases are accepted (`releases.py`), the options taken from vLLM's config and the environment
(`options.py`), the package's `vllm_backend` lookup (`__init__.py`), vLLM-Ascend's plug-in
(`ascend_plugin.py`) and the drafter compiled beside the target (`drafter.py`). vLLM's objects are
namespaces with the fields these modules read; the backend they would configure is a recorder. Each
test runs in milliseconds (the mutation selection of these modules, `tools/mutation/modules.toml`)."""
from __future__ import annotations

import importlib.metadata
import json
import logging
import sys
import types

import pytest
import torch

from ascend_compile.config import default_capture_sizes, default_piecewise_sizes
from ascend_compile.integrations import vllm as integration
from ascend_compile.integrations.vllm import ascend_plugin, drafter, dynamo_backend, options, releases

NS = types.SimpleNamespace


# ------------------------------------------------------------------------------------------ releases.py


def test_the_installed_release_is_read_from_vllms_package_metadata(monkeypatch):
    asked = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: asked.append(name) or "0.33.1")
    assert releases.installed_version() == "0.33.1"
    assert asked == ["vllm"]


def test_without_vllm_installed_the_release_lookup_fails_as_the_metadata_does():
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        releases.installed_version()


@pytest.mark.parametrize("release", ["0.23.0", "0.23.7.post1", "0.33.0", "0.33.12", "0.23"])
def test_a_supported_major_minor_is_accepted_whatever_its_patch(monkeypatch, release):
    monkeypatch.setattr(releases, "installed_version", lambda: release)
    assert releases.check_version() is None


@pytest.mark.parametrize("release", ["0.24.0", "0.3.3", "0.2.33", "1.0.23", "0.330.0", "10.23.0", "0.23x.0", "0"])
def test_another_release_is_refused_naming_it_the_supported_ones_and_why(monkeypatch, release):
    monkeypatch.setattr(releases, "installed_version", lambda: release)
    with pytest.raises(RuntimeError) as err:
        releases.check_version()
    assert str(err.value) == (
        f"vllm {release}: ascend_compile.integrations.vllm supports vLLM 0.23.x, 0.33.x (it reads the forward "
        f"context's attention metadata and KV caches, internals that change between releases); install a "
        f"supported version")


# ------------------------------------------------------------------------------------------- options.py


def _config(max_model_len=None, capture_sizes=None, tokens=None, speculative=None, **extra):
    """A vLLM config with the fields `options.py` reads (None: the field is there, unset)."""
    return NS(model_config=NS(max_model_len=max_model_len), compilation_config=NS(cudagraph_capture_sizes=capture_sizes),
              scheduler_config=NS(max_num_batched_tokens=tokens), speculative_config=speculative, **extra)


@pytest.fixture
def environment(monkeypatch):
    """`ASCEND_COMPILE_OPTIONS` unset; `set(dict)` sets it."""
    monkeypatch.delenv(options.OPTIONS_ENV, raising=False)
    return lambda value: monkeypatch.setenv(options.OPTIONS_ENV, json.dumps(value))


def test_the_environment_variable_is_named_ascend_compile_options():
    assert options.OPTIONS_ENV == "ASCEND_COMPILE_OPTIONS"


def test_vllms_config_gives_max_model_len_and_its_capture_sizes_sorted_as_ints():
    got = options.from_vllm_config(_config(max_model_len=4096.0, capture_sizes=[8, "1", 4]))
    assert got == {"max_model_len": 4096, "capture_sizes": [1, 4, 8]}
    assert type(got["max_model_len"]) is int and all(type(s) is int for s in got["capture_sizes"])


@pytest.mark.parametrize("config", [
    None,
    _config(),
    _config(max_model_len=0, capture_sizes=[]),
    NS(compilation_config=NS()),  # no model config, no capture sizes field
])
def test_what_vllms_config_leaves_unset_is_left_out(config):
    assert options.from_vllm_config(config) == {}


def test_only_the_fields_vllm_set_are_taken():
    assert options.from_vllm_config(_config(capture_sizes=[2])) == {"capture_sizes": [2]}
    assert options.from_vllm_config(NS(model_config=NS(max_model_len=64), compilation_config=NS())) == {
        "max_model_len": 64}


def test_the_environments_options_are_its_json_and_nothing_when_unset_or_empty(environment, monkeypatch):
    assert options.from_environment() == {}
    monkeypatch.setenv(options.OPTIONS_ENV, "")
    assert options.from_environment() == {}
    environment({"dispatch": "dynamo", "max_model_len": 7})
    assert options.from_environment() == {"dispatch": "dynamo", "max_model_len": 7}


def test_the_defaults_are_frozen_parameters_and_direct_dispatch(environment):
    assert options.DEFAULTS == {"frozen_parameters": True, "dispatch": "direct"}
    assert options.options_for(None) == options.DEFAULTS
    assert options.options_for(_config()) == options.DEFAULTS


def test_vllms_config_over_the_defaults_the_environment_over_both(environment):
    config = _config(max_model_len=2048, capture_sizes=[4, 2])
    assert options.options_for(config) == {**options.DEFAULTS, "max_model_len": 2048, "capture_sizes": [2, 4]}
    environment({"max_model_len": 512, "frozen_parameters": False, "dispatch": "dynamo"})
    assert options.options_for(config) == {"frozen_parameters": False, "dispatch": "dynamo", "max_model_len": 512,
                                           "capture_sizes": [2, 4]}


def test_piecewise_sizes_reach_vllms_most_tokens_a_step_from_the_capture_sizes_in_force(environment):
    assert options.options_for(_config(tokens=300))["piecewise_sizes"] == list(
        default_piecewise_sizes(default_capture_sizes(), 300))
    got = options.options_for(_config(capture_sizes=[1, 2, 3], tokens=100.0))["piecewise_sizes"]
    assert got == [1, 2, 3, 6, 12, 24, 48, 96, 100] == list(default_piecewise_sizes((1, 2, 3), 100))
    environment({"capture_sizes": [5]})  # the environment's capture sizes are those in force
    assert options.options_for(_config(capture_sizes=[1, 2, 3], tokens=100))["piecewise_sizes"] == [5, 10, 20, 40,
                                                                                                     80, 100]


def test_piecewise_sizes_are_left_alone_without_vllms_token_count_or_when_set(environment):
    assert "piecewise_sizes" not in options.options_for(_config(tokens=0))
    assert "piecewise_sizes" not in options.options_for(NS(compilation_config=NS()))
    environment({"piecewise_sizes": [7]})
    assert options.options_for(_config(tokens=100))["piecewise_sizes"] == [7]


def test_a_drafter_is_a_speculative_config_with_a_draft_model():
    assert options.has_drafter(NS(speculative_config=NS(draft_model_config=object())))
    assert not options.has_drafter(NS(speculative_config=NS(draft_model_config=None)))  # n-gram
    assert not options.has_drafter(NS(speculative_config=NS()))
    assert not options.has_drafter(NS(speculative_config=None))
    assert not options.has_drafter(NS())


def test_with_a_drafter_each_model_is_named_and_both_share_the_engines_workspace_group(environment):
    speculative = NS(draft_model_config=object())
    config = _config(speculative=speculative)
    group = f"vllm-speculative-{id(speculative):x}"
    assert options.SPECULATIVE_GROUP.format(id(speculative)) == group
    target, draft = options.options_for(config), options.options_for(config, "eagle_head")
    assert target == {**options.DEFAULTS, "model_name": "backbone", "workspace_group": group}
    assert draft == {**options.DEFAULTS, "model_name": "eagle_head", "workspace_group": group}
    other = NS(draft_model_config=object())
    assert options.options_for(_config(speculative=other))["workspace_group"] == f"vllm-speculative-{id(other):x}"
    environment({"model_name": "mine"})
    assert options.options_for(config)["model_name"] == "mine"


def test_a_model_tag_names_the_model_even_without_a_drafter(environment):
    config = _config()
    assert options.options_for(config, "encoder") == {
        **options.DEFAULTS, "model_name": "encoder", "workspace_group": f"vllm-speculative-{id(None):x}"}
    assert options.TARGET_TAG == "backbone"
    assert options._speculative(NS(), "encoder")["workspace_group"] == f"vllm-speculative-{id(None):x}"  # no such field


def test_the_current_vllm_config_is_none_without_vllm():
    assert options.current_vllm_config() is None


def test_the_current_vllm_config_is_the_one_vllm_has_set(monkeypatch):
    config = object()
    module = types.ModuleType("vllm.config")
    module.get_current_vllm_config_or_none = lambda: config
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config", module)
    assert options.current_vllm_config() is config


# ------------------------------------------------------------------------------------------ __init__.py


def test_vllm_backend_is_made_at_each_lookup_and_installs_the_drafters_compile(monkeypatch):
    config, installed, made = object(), [], []
    monkeypatch.setattr(options, "current_vllm_config", lambda: config)
    monkeypatch.setattr(drafter, "install", installed.append)
    monkeypatch.setattr(dynamo_backend, "configured_backend", lambda c, tag=None: made.append((c, tag)) or made)
    monkeypatch.setattr(dynamo_backend, "current_vllm_config", lambda: config)
    assert integration.vllm_backend is made
    assert installed == [config] and made == [(config, None)]
    assert integration.__getattr__("vllm_backend") is made and installed == [config, config]


def test_another_missing_name_of_the_package_is_an_attribute_error():
    with pytest.raises(AttributeError) as err:
        integration.__getattr__("no_such_name")
    assert str(err.value) == "module 'ascend_compile.integrations.vllm' has no attribute 'no_such_name'"
    assert not hasattr(integration, "vllm_backends")


# ------------------------------------------------------------------------------------- ascend_plugin.py


class _Runner:
    """vLLM-Ascend's `NPUModelRunner` as the plug-in sees it: `load_model` loads (records the call)."""

    def __init__(self, config=None, model=None):
        self.vllm_config, self.model, self.loads = config, model, []

    def load_model(self, *args, **kwargs):
        """Load the model."""
        self.loads.append((args, kwargs))
        return "loaded"


class _Model(torch.nn.Module):
    """A model whose `compile` records its arguments instead of compiling."""

    def __init__(self):
        super().__init__()
        self.compiled_with = []

    def compile(self, *args, **kwargs):
        self.compiled_with.append((args, kwargs))


def _mode(name):
    return types.SimpleNamespace(name=name)


def _vllm_ascend_config(graphs="NONE", mode="NONE"):
    return NS(compilation_config=NS(cudagraph_mode=graphs, mode=mode), speculative_config=None,
              model_config=NS(max_model_len=None))


@pytest.fixture
def plugin_logs(caplog):
    caplog.set_level(logging.INFO, logger="ascend_compile")
    return caplog


def test_the_plugin_is_opted_in_by_its_variable_alone(monkeypatch, plugin_logs):
    imported = []
    monkeypatch.setattr(ascend_plugin.importlib, "import_module", lambda name: imported.append(name))
    assert ascend_plugin.ENV == "ASCEND_COMPILE_VLLM_ASCEND"
    for value in (None, "0", "true", "11"):
        if value is None:
            monkeypatch.delenv(ascend_plugin.ENV, raising=False)
        else:
            monkeypatch.setenv(ascend_plugin.ENV, value)
        ascend_plugin.register()
    assert imported == []
    assert plugin_logs.messages == ["ascend_compile: ascend_graph not in use for vLLM-Ascend: "
                                    "ASCEND_COMPILE_VLLM_ASCEND is not 1"] * 4


def test_opted_in_without_vllm_ascend_the_plugin_says_why_it_is_not_in_use(monkeypatch, plugin_logs):
    monkeypatch.setenv(ascend_plugin.ENV, "1")
    monkeypatch.delitem(sys.modules, ascend_plugin.RUNNER_MODULE, raising=False)
    ascend_plugin.register()
    (record,) = plugin_logs.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "ascend_compile: ascend_graph not in use: ASCEND_COMPILE_VLLM_ASCEND=1 but "
        "vllm_ascend.worker.model_runner_v1.NPUModelRunner does not import (ModuleNotFoundError: "
        "No module named 'vllm_ascend')")


def test_opted_in_a_module_without_the_runner_class_is_not_in_use_either(monkeypatch, plugin_logs):
    monkeypatch.setenv(ascend_plugin.ENV, "1")
    monkeypatch.setitem(sys.modules, ascend_plugin.RUNNER_MODULE, types.ModuleType(ascend_plugin.RUNNER_MODULE))
    ascend_plugin.register()
    assert "NPUModelRunner does not import (AttributeError: " in plugin_logs.text


def test_opted_in_the_plugin_wraps_vllm_ascends_runner(monkeypatch):
    module = types.ModuleType(ascend_plugin.RUNNER_MODULE)
    module.NPUModelRunner = type("NPUModelRunner", (_Runner,), {})
    monkeypatch.setitem(sys.modules, ascend_plugin.RUNNER_MODULE, module)
    monkeypatch.setenv(ascend_plugin.ENV, "1")
    assert (ascend_plugin.RUNNER_MODULE, ascend_plugin.RUNNER_CLASS) == ("vllm_ascend.worker.model_runner_v1",
                                                                          "NPUModelRunner")
    ascend_plugin.register()
    assert getattr(module.NPUModelRunner.load_model, ascend_plugin._WRAPPED) is True
    assert _Runner.load_model.__name__ == "load_model" and not hasattr(_Runner.load_model, ascend_plugin._WRAPPED)


def test_the_wrapped_load_model_loads_then_compiles_once_per_class(monkeypatch):
    compiled = []
    monkeypatch.setattr(ascend_plugin, "compile_loaded", lambda runner: compiled.append((runner, list(runner.loads))))
    cls = type("NPUModelRunner", (_Runner,), {})
    ascend_plugin.wrap_load_model(cls)
    wrapped = cls.load_model
    ascend_plugin.wrap_load_model(cls)  # a second registration (another plug-in load) wraps nothing more
    assert cls.load_model is wrapped and wrapped.__name__ == "load_model" and wrapped.__doc__ == "Load the model."
    runner = cls()
    assert runner.load_model(1, key=2) == "loaded"
    assert runner.loads == [((1,), {"key": 2})]
    assert compiled == [(runner, [((1,), {"key": 2})])]  # after the load


@pytest.mark.parametrize("graphs, mode", [("NONE", "NONE"), (_mode("NONE"), _mode("NONE")), ("NONE", 0),
                                          (_mode("NONE"), "0")])
def test_an_eager_vllm_ascend_is_compiled_by_us(graphs, mode):
    assert ascend_plugin.why_not(_vllm_ascend_config(graphs, mode)) is None


@pytest.mark.parametrize("graphs, shown", [(_mode("FULL_AND_PIECEWISE"), "FULL_AND_PIECEWISE"), ("PIECEWISE", "PIECEWISE")])
def test_vllm_ascends_own_graphs_keep_the_plugin_out_naming_the_mode(graphs, shown):
    assert ascend_plugin.why_not(_vllm_ascend_config(graphs, _mode("VLLM_COMPILE"))) == (
        f"vLLM-Ascend captures ACL graphs itself (compilation_config.cudagraph_mode={shown}); run it eagerly "
        f"(enforce_eager=True) so that ascend_graph captures them")


@pytest.mark.parametrize("mode, shown", [(_mode("VLLM_COMPILE"), "VLLM_COMPILE"), (3, "3"), ("1", "1")])
def test_vllm_ascends_own_compile_keeps_the_plugin_out_naming_the_mode(mode, shown):
    assert ascend_plugin.why_not(_vllm_ascend_config("NONE", mode)) == (
        f"vLLM-Ascend compiles the model itself (compilation_config.mode={shown}); run it eagerly "
        f"(enforce_eager=True) so that ascend_graph compiles it")


@pytest.fixture
def backends(monkeypatch):
    """`configured_backend` and the drafter's compile recorded, not run."""
    made, drafters = [], []
    monkeypatch.setattr(dynamo_backend, "configured_backend",
                        lambda config, tag=None: made.append((config, tag)) or f"backend-{len(made)}")
    monkeypatch.setattr(drafter, "compile_runner_drafter", drafters.append)
    monkeypatch.delenv(options.OPTIONS_ENV, raising=False)
    return made, drafters


def test_the_loaded_model_and_its_drafter_are_compiled_with_the_runners_backend(backends, plugin_logs):
    made, drafters = backends
    config = _vllm_ascend_config()
    runner = _Runner(config, _Model())
    ascend_plugin.compile_loaded(runner)
    assert made == [(config, None)] and drafters == [runner]
    assert runner.model.compiled_with == [((), {"fullgraph": True, "backend": "backend-1"})]
    assert plugin_logs.messages == [
        f"ascend_compile: ascend_graph in use for vLLM-Ascend's _Runner: the model is compiled with it (options "
        f"{options.options_for(config)})"]
    plugin_logs.clear()
    config.model_config.max_model_len = 4096  # the options logged are the runner's config's
    ascend_plugin.compile_loaded(_Runner(config, _Model()))
    assert "'max_model_len': 4096" in plugin_logs.messages[-1]


def test_with_vllm_ascends_own_graphs_nothing_is_compiled_and_a_warning_says_why(backends, plugin_logs):
    made, drafters = backends
    runner = _Runner(_vllm_ascend_config(graphs="FULL"), _Model())
    ascend_plugin.compile_loaded(runner)
    assert made == [] and drafters == [] and runner.model.compiled_with == []
    (record,) = plugin_logs.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "ascend_compile: ascend_graph not in use: " + ascend_plugin.why_not(runner.vllm_config)


# ------------------------------------------------------------------------------------------ drafter.py


def test_the_drafter_model_is_the_runners_drafters_module_if_any():
    model = _Model()
    assert drafter.drafter_model(NS(drafter=NS(model=model))) is model
    assert drafter.drafter_model(NS(drafter=NS(model="not a module"))) is None
    assert drafter.drafter_model(NS(drafter=NS())) is None  # n-gram: a proposer without a model
    assert drafter.drafter_model(NS()) is None


@pytest.fixture
def drafter_backends(monkeypatch):
    made = []
    monkeypatch.setattr(drafter, "configured_backend",
                        lambda config, tag=None: made.append((config, tag)) or f"backend-{tag}")
    return made


def test_the_drafter_is_compiled_as_vllm_compiles_the_target_under_its_own_tag(drafter_backends, plugin_logs):
    model, config = _Model(), object()
    drafter.compile_drafter(model, config)
    drafter.compile_drafter(model, config, "mtp")
    assert drafter_backends == [(config, "eagle_head"), (config, "mtp")]
    assert model.compiled_with == [((), {"fullgraph": True, "backend": "backend-eagle_head"}),
                                   ((), {"fullgraph": True, "backend": "backend-mtp"})]
    assert plugin_logs.messages == [
        "ascend_compile: the drafter _Model is compiled with ascend_graph beside the target (model tag 'eagle_head')",
        "ascend_compile: the drafter _Model is compiled with ascend_graph beside the target (model tag 'mtp')"]


def test_a_runners_drafter_is_compiled_if_it_has_one(drafter_backends):
    model, config = _Model(), object()
    assert drafter.compile_runner_drafter(NS(drafter=NS(model=model), vllm_config=config)) is True
    assert drafter_backends == [(config, "eagle_head")] and len(model.compiled_with) == 1
    assert drafter.compile_runner_drafter(NS(drafter=None, vllm_config=config)) is False
    assert drafter_backends == [(config, "eagle_head")]


def _gpu_config(mode=1, backend=drafter.BACKEND_NAME, draft=True):
    return NS(compilation_config=NS(mode=mode, backend=backend),
              speculative_config=NS(draft_model_config=object() if draft else None))


def test_vllm_compiles_with_our_backend_under_mode_1_naming_it():
    assert drafter.BACKEND_NAME == "ascend_compile.integrations.vllm.vllm_backend"
    assert drafter.ours(_gpu_config())
    assert not drafter.ours(_gpu_config(mode=3))
    assert not drafter.ours(_gpu_config(mode=0))
    assert not drafter.ours(_gpu_config(backend="inductor"))


class _Mode:
    """vLLM's `CompilationMode` (an int enum): compared as an int."""

    def __init__(self, value):
        self.value = value

    def __int__(self):
        return self.value


def test_vllms_compilation_mode_is_read_as_an_int():
    assert drafter.ours(_gpu_config(mode=_Mode(1))) and not drafter.ours(_gpu_config(mode=_Mode(2)))


def test_the_drafter_is_compiled_before_the_first_forward_once_and_only_under_our_backend(drafter_backends):
    model = _Model()
    runner = NS(drafter=NS(model=model), vllm_config=_gpu_config())
    drafter.ensure_drafter_compiled(runner)
    assert len(model.compiled_with) == 1
    model._compiled_call_impl = object()  # what `Module.compile` sets
    drafter.ensure_drafter_compiled(runner)
    assert len(model.compiled_with) == 1
    other = _Model()
    drafter.ensure_drafter_compiled(NS(drafter=NS(model=other), vllm_config=_gpu_config(backend="inductor")))
    drafter.ensure_drafter_compiled(NS(drafter=None, vllm_config=_gpu_config()))
    assert other.compiled_with == [] and len(drafter_backends) == 1
    assert drafter_backends[0][0] is runner.vllm_config  # the drafter's backend is configured from the runner's


def _gpu_runner_cls():
    calls = []

    class GPUModelRunner:
        def _dummy_run(self, *args, **kwargs):
            """The profiling run."""
            calls.append(("_dummy_run", args, kwargs))
            return "dummy"

        def execute_model(self, *args, **kwargs):
            calls.append(("execute_model", args, kwargs))
            return "executed"

        def other(self):
            return "other"

    return GPUModelRunner, calls


def test_both_ways_to_the_first_forward_compile_the_drafter_first_once_per_class(monkeypatch):
    cls, calls = _gpu_runner_cls()
    monkeypatch.setattr(drafter, "ensure_drafter_compiled", lambda runner: calls.append(("ensure", runner)))
    other = cls.other
    drafter.wrap_runner(cls)
    dummy, execute = cls._dummy_run, cls.execute_model
    drafter.wrap_runner(cls)
    assert (cls._dummy_run, cls.execute_model, cls.other) == (dummy, execute, other)
    assert dummy.__name__ == "_dummy_run" and dummy.__doc__ == "The profiling run."
    assert drafter.FIRST_FORWARD == ("_dummy_run", "execute_model")
    runner = cls()
    assert runner._dummy_run(1, k=2) == "dummy" and runner.execute_model(3) == "executed"
    assert calls == [("ensure", runner), ("_dummy_run", (1,), {"k": 2}), ("ensure", runner),
                     ("execute_model", (3,), {})]
    # a subclass overriding one of them (vLLM-Ascend's runner overrides `execute_model`): that one is wrapped
    # too, the inherited one left as it is
    sub = type("NPURunner", (cls,), {"execute_model": lambda self: calls.append("sub") or "sub"})
    drafter.wrap_runner(sub)
    calls.clear()
    assert sub._dummy_run is dummy and sub().execute_model() == "sub"
    assert [c[0] if isinstance(c, tuple) else c for c in calls] == ["ensure", "sub"]


def test_install_wraps_vllms_gpu_runner_when_there_is_a_drafter(monkeypatch, plugin_logs):
    cls, _ = _gpu_runner_cls()
    module = types.ModuleType(drafter.RUNNER_MODULE)
    module.GPUModelRunner = cls
    monkeypatch.setitem(sys.modules, drafter.RUNNER_MODULE, module)
    assert (drafter.RUNNER_MODULE, drafter.RUNNER_CLASS) == ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
    plain = cls._dummy_run
    drafter.install(None)
    drafter.install(_gpu_config(draft=False))
    assert cls._dummy_run is plain
    drafter.install(_gpu_config())
    assert getattr(cls._dummy_run, drafter._WRAPPED) and getattr(cls.execute_model, drafter._WRAPPED)
    assert plugin_logs.messages == []


def test_install_without_vllms_gpu_runner_imported_says_where_the_drafter_is_compiled(monkeypatch, plugin_logs):
    monkeypatch.delitem(sys.modules, drafter.RUNNER_MODULE, raising=False)
    drafter.install(_gpu_config())
    assert plugin_logs.messages == [
        "ascend_compile: vllm.v1.worker.gpu_model_runner.GPUModelRunner not imported: the drafter is compiled "
        "where compile_runner_drafter is called"]
