"""Regenerate `tests/fixtures/vllm_<version>.json` from unpacked vLLM (and vLLM-Ascend) source trees.

The fixture pins what the vLLM integration and its test stand-in (`tests/vllm_standin.py`) must match:
the schema strings of vLLM's attention custom ops, the forward-context attribute names, the
attention layer's attributes, and the attention-metadata fields of the main backends. vLLM is never
imported: its files are parsed with `ast`, and each op's schema is inferred the way vLLM's
`direct_register_custom_op` does it (`torch.library.infer_schema(op_func, mutates_args=...)`), on a
stub function with the op function's exact parameter list.

    pip download --no-deps vllm==0.23.0 -d /tmp/vllm_wheel
    (cd /tmp/vllm_src && unzip -q /tmp/vllm_wheel/vllm-0.23.0-*.whl -x '*.so')
    pip download --no-deps --no-build-isolation vllm-ascend==0.23.0.post1 -d /tmp/vllm_ascend_wheel
        (the sdist; needs setuptools_scm and SOC_VERSION=ascend910b1 to prepare its metadata)
    (cd /tmp/vllm_ascend_wheel && tar xzf vllm_ascend-0.23.0.post1.tar.gz)
    python tools/extract_vllm_fixture.py --vllm /tmp/vllm_src --wheel /tmp/vllm_wheel/vllm-0.23.0-*.whl \
        --vllm-ascend /tmp/vllm_ascend_wheel/vllm_ascend-0.23.0.post1 \
        --vllm-ascend-archive /tmp/vllm_ascend_wheel/vllm_ascend-0.23.0.post1.tar.gz

`--check FIXTURE` regenerates and compares instead of writing (exit status 1 on a difference).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from pathlib import Path

import torch

# Files read, relative to the vLLM package root's parent (the unpacked wheel).
ATTENTION = "vllm/model_executor/layers/attention/attention.py"
TORCH_UTILS = "vllm/utils/torch_utils.py"
ENVS = "vllm/envs.py"
FORWARD_CONTEXT = "vllm/forward_context.py"
BACKEND = "vllm/v1/attention/backend.py"
FLASH_ATTN = "vllm/v1/attention/backends/flash_attn.py"
WORKER_UTILS = "vllm/v1/worker/utils.py"
COMPILER_INTERFACE = "vllm/compilation/compiler_interface.py"
VERSION = "vllm/_version.py"
# vLLM-Ascend, relative to its source tree.
ASCEND_ATTENTION = "vllm_ascend/attention/attention_v1.py"
ASCEND_ACL_GRAPH = "vllm_ascend/compilation/acl_graph.py"
ASCEND_COMPILER = "vllm_ascend/compilation/compiler_interface.py"
ASCEND_PLATFORM = "vllm_ascend/platform.py"

#: The opaque type vLLM uses for layer names on torch >= 2.11 (`vllm/utils/torch_utils.py: LayerName`).
LAYER_NAME_TYPE = "vllm.utils.torch_utils.LayerName"


class _Source:
    """One parsed file: its tree, its text, and where it came from."""

    def __init__(self, root: Path, rel: str):
        self.rel = rel
        self.text = (root / rel).read_text()
        self.tree = ast.parse(self.text)

    def top(self, name: str, kind=(ast.FunctionDef, ast.ClassDef)):
        for node in self.tree.body:
            if isinstance(node, kind) and node.name == name:
                return node
        raise LookupError(f"{self.rel}: no top-level {name!r}")

    def lines(self, node: ast.AST) -> str:
        start = node.lineno
        if getattr(node, "decorator_list", None):
            start = min(d.lineno for d in node.decorator_list)
        return f"{self.rel}:{start}-{node.end_lineno}"


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"class {cls.name}: no method {name!r}")


def _class_fields(cls: ast.ClassDef) -> dict[str, str]:
    """Annotated class-level fields (a dataclass's fields), name -> annotation source."""
    return {
        n.target.id: ast.unparse(n.annotation)
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def _class_attr(cls: ast.ClassDef, name: str):
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name and n.value:
            return ast.literal_eval(n.value)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return ast.literal_eval(n.value)
    return None


def _returned_source(cls: ast.ClassDef, name: str) -> str | None:
    """The source of the first `return` of a method, or None where the class has no such method."""
    try:
        fn = _method(cls, name)
    except LookupError:
        return None
    return ast.unparse(next(n for n in ast.walk(fn) if isinstance(n, ast.Return)).value)


def _self_attrs(fn: ast.FunctionDef) -> list[str]:
    """Names assigned as `self.X = ...` in a method, in order of first assignment."""
    seen: list[str] = []
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                if t.attr not in seen:
                    seen.append(t.attr)
    return sorted(seen, key=lambda a: _first_line(fn, a))


def _first_line(fn: ast.FunctionDef, attr: str) -> int:
    return min(
        n.lineno for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr == attr
    )


def _attrs_of(fn: ast.AST, var: str) -> list[str]:
    """Attribute names read from the local `var` in `fn` (`var.X`), sorted."""
    return sorted({
        n.attr for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == var
    })


def _subscript_attrs(fn: ast.AST, container: str) -> list[str]:
    """Attribute names read from `container[...]` or `container[...][...]` (e.g. `attn_metadata[key].seq_lens`)."""
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Subscript):
            base = n.value.value
            while isinstance(base, ast.Subscript):
                base = base.value
            name = ast.unparse(base)
            if name == container or name.endswith("." + container):
                out.add(n.attr)
    return sorted(out)


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def _signature_source(fn: ast.FunctionDef) -> str:
    """`def name(<params as written>) -> <return as written>: ...` of a function definition."""
    ret = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    return f"def {fn.name}({ast.unparse(fn.args)}){ret}: ..."


# ------------------------------------------------------------------ schemas


def layer_name_class():
    """A class named like vLLM's `LayerName`, registered as the same opaque value type when torch can."""
    try:
        from torch._opaque_base import OpaqueBase
        from torch._library.opaque_object import register_opaque_type
    except ImportError:
        return None

    class LayerName(OpaqueBase):
        def __init__(self, value: str):
            self.value = value

        def __eq__(self, other):
            return isinstance(other, LayerName) and self.value == other.value

        def __hash__(self):
            return hash(self.value)

        def __fx_repr__(self):
            return (f"LayerName({self.value!r})", {"LayerName": LayerName})

    LayerName.__module__, LayerName.__qualname__ = LAYER_NAME_TYPE.rsplit(".", 1)
    register_opaque_type(LayerName, typ="value", hoist=True)
    return LayerName


def infer(fn: ast.FunctionDef, mutates_args: list[str], layer_name_type) -> str:
    """The schema `direct_register_custom_op` infers for `fn`, with `LayerNameType` bound as given."""
    namespace = {"torch": torch, "LayerNameType": layer_name_type}
    exec(_signature_source(fn), namespace)  # noqa: S102 - the stub only declares the signature
    return torch.library.infer_schema(namespace[fn.name], mutates_args=mutates_args)


def registered_ops(src: _Source) -> list[dict]:
    """Every `direct_register_custom_op(...)` call of a file, with its op function's signature."""
    ops = []
    for node in src.tree.body:
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        if not (isinstance(call.func, ast.Name) and call.func.id == "direct_register_custom_op"):
            continue
        kw = {k.arg: k.value for k in call.keywords}
        op_func = src.top(kw["op_func"].id, ast.FunctionDef)
        mutates = ast.literal_eval(kw["mutates_args"]) if "mutates_args" in kw else []
        ops.append({
            "name": ast.literal_eval(kw["op_name"]),
            "op_func": op_func,
            "mutates_args": list(mutates),
            "registered_at": src.lines(node),
            "defined_at": src.lines(op_func),
        })
    return ops


def layer_name_rule(torch_utils: _Source, envs: _Source) -> dict:
    """When vLLM's op schemas take `str layer_name` and when its opaque `LayerName`."""
    text = torch_utils.text
    opaque = re.search(r'HAS_OPAQUE_TYPE\s*=\s*is_torch_equal_or_newer\("([^"]+)"\)', text)
    use = re.search(r"^_USE_LAYERNAME\s*=\s*(.+)$", text, re.M)
    alias = re.search(r"^\s+LayerNameType\s*=\s*(.+)$", text, re.M)
    default = re.search(r'"VLLM_USE_LAYERNAME":\s*lambda:\s*bool\(int\(os\.getenv\("VLLM_USE_LAYERNAME",\s*"(\d)"\)\)\)', envs.text)
    if not (opaque and use and alias and default):
        raise LookupError(f"{torch_utils.rel}/{envs.rel}: the LayerName switch is not where it was")
    return {
        "opaque_type_from_torch": opaque.group(1),
        "switch": use.group(1).strip(),
        "alias": alias.group(1).strip(),
        "env": "VLLM_USE_LAYERNAME",
        "env_default": default.group(1),
        "opaque_type_name": LAYER_NAME_TYPE,
        "where": [torch_utils.rel, envs.rel],
    }


# ------------------------------------------------------------------ the fixture


def _file_digest(path: Path | None) -> dict | None:
    if path is None:
        return None
    return {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def extract(vllm_root: Path, ascend_root: Path | None, wheel: Path | None, ascend_archive: Path | None) -> dict:
    attention = _Source(vllm_root, ATTENTION)
    torch_utils = _Source(vllm_root, TORCH_UTILS)
    envs = _Source(vllm_root, ENVS)
    fwd = _Source(vllm_root, FORWARD_CONTEXT)
    backend = _Source(vllm_root, BACKEND)
    flash = _Source(vllm_root, FLASH_ATTN)
    worker_utils = _Source(vllm_root, WORKER_UTILS)
    compiler_interface = _Source(vllm_root, COMPILER_INTERFACE)
    version = re.search(r"__version__ = version = '([^']+)'", (vllm_root / VERSION).read_text()).group(1)
    commit = re.search(r"__commit_id__ = commit_id = '([^']+)'", (vllm_root / VERSION).read_text())

    layer_name_cls = layer_name_class()
    ops = {}
    for op in registered_ops(attention):
        if op["name"] not in ("unified_attention_with_output", "unified_kv_cache_update", "unified_attention"):
            continue
        fn = op["op_func"]
        entry = {
            "qualname": f"vllm::{op['name']}",
            "schema_str_layer_name": infer(fn, op["mutates_args"], str),
            "schema_opaque_layer_name": infer(fn, op["mutates_args"], layer_name_cls) if layer_name_cls else None,
            "python_signature": _signature_source(fn),
            "mutates_args": op["mutates_args"],
            "registered_at": op["registered_at"],
            "defined_at": op["defined_at"],
        }
        ops[entry["qualname"]] = entry
    for needed in ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update"):
        if needed not in ops:
            raise LookupError(f"{ATTENTION}: {needed} is not registered there")

    # Forward context.
    fc_cls = fwd.top("ForwardContext", ast.ClassDef)
    forward_context = {
        "module": "vllm.forward_context",
        "class": "ForwardContext",
        "fields": list(_class_fields(fc_cls)),
        "field_types": _class_fields(fc_cls),
        "functions": {
            name: _params(fwd.top(name, ast.FunctionDef))
            for name in ("get_forward_context", "is_forward_context_available", "create_forward_context",
                         "override_forward_context", "set_forward_context")
        },
        "no_compile_layers_from": "vllm_config.compilation_config.static_forward_context",
        "where": {"ForwardContext": fwd.lines(fc_cls),
                  "set_forward_context": fwd.lines(fwd.top("set_forward_context", ast.FunctionDef)),
                  "create_forward_context": fwd.lines(fwd.top("create_forward_context", ast.FunctionDef))},
    }
    if "vllm_config.compilation_config.static_forward_context" not in ast.unparse(fwd.top("create_forward_context")):
        raise LookupError(f"{FORWARD_CONTEXT}: no_compile_layers no longer comes from static_forward_context")

    # How the ops reach the metadata, the layer and the cache.
    gac = attention.top("get_attention_context", ast.FunctionDef)
    uawo = attention.top("unified_attention_with_output", ast.FunctionDef)
    ukcu = attention.top("unified_kv_cache_update", ast.FunctionDef)
    impl_forward = next(
        n for n in ast.walk(uawo)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.impl.forward"
    )
    kv_update = next(
        n for n in ast.walk(ukcu)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "attn_layer.impl.do_kv_cache_update"
    )
    op_context = {
        "get_attention_context": {
            "params": _params(gac),
            "forward_context_attrs": _attrs_of(gac, "forward_context"),
            "layer_attrs": _attrs_of(gac, "attn_layer"),
            "returns": ast.unparse(next(n for n in ast.walk(gac) if isinstance(n, ast.Return)).value),
            "attn_metadata_forms": ["dict[layer_name]", "list[0][layer_name] (DBO / spec decode)", "object (same for all)"],
            "where": attention.lines(gac),
        },
        "unified_attention_with_output_calls": ast.unparse(impl_forward),
        "unified_kv_cache_update_calls": ast.unparse(kv_update),
        "unified_kv_cache_update_returns": ast.unparse([n for n in ast.walk(ukcu) if isinstance(n, ast.Return)][-1].value),
        "layer_name_resolution": "_resolve_layer_name(layer_name): LayerName -> .value, str unchanged",
    }

    # The Attention layer.
    attn_cls = attention.top("Attention", ast.ClassDef)
    fwd_fn = _method(attn_cls, "forward")
    op_calls = [
        ast.unparse(n) for n in ast.walk(fwd_fn)
        if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("torch.ops.vllm.")
    ]
    attention_layer = {
        "class": "vllm.model_executor.layers.attention.attention.Attention",
        "init_params": _params(_method(attn_cls, "__init__"))[1:],
        "init_self_attrs": _self_attrs(_method(attn_cls, "__init__")),
        "forward_params": _params(fwd_fn)[1:],
        "forward_op_calls": op_calls,
        "forward_allocates_output": "output = torch.empty(output_shape, dtype=output_dtype, device=query.device)"
        in ast.unparse(fwd_fn),
        "registers_in": "compilation_config.static_forward_context[prefix] = self",
        "kv_cache_placeholder": "self.kv_cache = torch.tensor([])",
        "where": {"Attention": attention.lines(attn_cls), "forward": attention.lines(fwd_fn)},
    }
    init_src = ast.unparse(_method(attn_cls, "__init__"))
    for needle in ("compilation_config.static_forward_context[prefix] = self", "self.kv_cache = torch.tensor([])"):
        if needle not in init_src:
            raise LookupError(f"{ATTENTION}: Attention.__init__ no longer does {needle!r}")
    # 0.23's bind_kv_cache assigns the attribute; 0.33's bind_kv_cache_to_layers calls a layer method.
    forms = ("forward_context[layer_name].kv_cache = kv_cache", "forward_context[layer_name].bind_kv_cache(kv_cache)")
    binders = [n for n in worker_utils.tree.body
               if isinstance(n, ast.FunctionDef) and n.name in ("bind_kv_cache", "bind_kv_cache_to_layers")]
    found = [(f, b) for b in binders for f in forms if f in ast.unparse(b)]
    if not found:
        raise LookupError(f"{WORKER_UTILS}: bind_kv_cache no longer binds one cache per layer")
    attention_layer["kv_cache_bound_by"] = {"code": found[0][0], "where": worker_utils.lines(found[0][1])}

    # Backends.
    base_cls = backend.top("AttentionBackend", ast.ClassDef)
    fa_backend = flash.top("FlashAttentionBackend", ast.ClassDef)
    fa_meta = flash.top("FlashAttentionMetadata", ast.ClassDef)
    backends = {
        "default_forward_includes_kv_cache_update": _class_attr(base_cls, "forward_includes_kv_cache_update"),
        "FLASH_ATTN": {
            "metadata_class": "vllm.v1.attention.backends.flash_attn.FlashAttentionMetadata",
            "metadata_fields": list(_class_fields(fa_meta)),
            "metadata_field_types": _class_fields(fa_meta),
            "forward_includes_kv_cache_update": _class_attr(fa_backend, "forward_includes_kv_cache_update"),
            "impl_init_self_attrs": _self_attrs(_method(flash.top("FlashAttentionImpl", ast.ClassDef), "__init__")),
            "kv_cache_shape": _returned_source(fa_backend, "get_kv_cache_shape"),
            "where": {"FlashAttentionMetadata": flash.lines(fa_meta), "FlashAttentionBackend": flash.lines(fa_backend)},
        },
    }
    split = [ast.unparse(n) for n in ast.walk(_method(flash.top("FlashAttentionImpl", ast.ClassDef), "do_kv_cache_update"))
             if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "(key_cache, value_cache)"]
    backends["FLASH_ATTN"]["kv_cache_split"] = split[0] if split else None

    ci = compiler_interface.top("CompilerInterface", ast.ClassDef)
    compile_api = {
        "CompilerInterface": {
            m.name: _params(m)[1:] for m in ci.body if isinstance(m, ast.FunctionDef)
        },
        "where": compiler_interface.lines(ci),
    }

    sources = {
        "vllm": {"version": version, "commit": commit.group(1) if commit else None, "wheel": _file_digest(wheel),
                 "files": sorted({attention.rel, torch_utils.rel, envs.rel, fwd.rel, backend.rel, flash.rel,
                                  worker_utils.rel, compiler_interface.rel, VERSION})},
    }
    fixture = {
        "source": sources,
        "generated_by": "tools/extract_vllm_fixture.py",
        "torch_used_for_infer_schema": torch.__version__.split("+")[0],
        "layer_name": layer_name_rule(torch_utils, envs),
        "ops": ops,
        "forward_context": forward_context,
        "op_context": op_context,
        "attention_layer": attention_layer,
        "backends": backends,
        "compile": compile_api,
    }
    if ascend_root is not None:
        fixture["vllm_ascend"] = extract_ascend(ascend_root)
        fixture["source"]["vllm_ascend"] = {
            "version": fixture["vllm_ascend"].pop("version"),
            "sdist": _file_digest(ascend_archive),
            "files": [ASCEND_ATTENTION, ASCEND_ACL_GRAPH, ASCEND_COMPILER, ASCEND_PLATFORM],
        }
    return fixture


def extract_ascend(root: Path) -> dict:
    attn = _Source(root, ASCEND_ATTENTION)
    acl = _Source(root, ASCEND_ACL_GRAPH)
    compiler = _Source(root, ASCEND_COMPILER)
    platform = _Source(root, ASCEND_PLATFORM)
    pkg_info = (root / "PKG-INFO").read_text() if (root / "PKG-INFO").exists() else ""
    version = re.search(r"^Version: (.+)$", pkg_info, re.M)
    meta = attn.top("AscendMetadata", ast.ClassDef)
    backend = attn.top("AscendAttentionBackend", ast.ClassDef)
    impl = attn.top("AscendAttentionBackendImpl", ast.ClassDef)
    update = _method(impl, "update_graph_params")
    # The captured parameter tuples update_graph_params unpacks, one per branch (PA, FIA v2 with sinks, FIA).
    unpacked = [
        [ast.unparse(e) for e in n.targets[0].elts]
        for n in ast.walk(update)
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple) and ast.unparse(n.value) == "param"
    ]
    platform_cls = platform.top("NPUPlatform", ast.ClassDef)

    def returned(name):
        return ast.literal_eval(next(n for n in ast.walk(_method(platform_cls, name)) if isinstance(n, ast.Return)).value)

    return {
        "version": version.group(1) if version else None,
        "AscendMetadata": {
            "class": "vllm_ascend.attention.attention_v1.AscendMetadata",
            "fields": list(_class_fields(meta)),
            "field_types": _class_fields(meta),
            "where": attn.lines(meta),
        },
        "backend": {
            # None: not set there, so vLLM's AttentionBackend default (the fixture's
            # backends.default_forward_includes_kv_cache_update) holds.
            "forward_includes_kv_cache_update": _class_attr(backend, "forward_includes_kv_cache_update"),
            "kv_cache_shape": ast.unparse(next(
                n for n in ast.walk(_method(backend, "get_kv_cache_shape")) if isinstance(n, ast.Return)).value),
            "layer_kv_cache": "(k_cache, v_cache), each get_kv_cache_shape(...)[1:]",
            "impl_init_self_attrs": _self_attrs(_method(impl, "__init__")),
            "where": attn.lines(backend),
        },
        "update_graph_params": {
            "metadata_attrs_read": _subscript_attrs(update, "attn_metadata"),
            "captured_param_tuples": unpacked,
            "where": attn.lines(update),
        },
        "impl_metadata_attrs": sorted({
            a for m in impl.body if isinstance(m, ast.FunctionDef) and m.name != "update_graph_params"
            for a in _attrs_of(m, "attn_metadata")
        }),
        "update_full_graph_params": acl.lines(acl.top("update_full_graph_params", ast.FunctionDef)),
        "ACLGraphWrapper": acl.lines(acl.top("ACLGraphWrapper", ast.ClassDef)),
        "AscendCompiler": compiler.lines(compiler.top("AscendCompiler", ast.ClassDef)),
        "platform": {
            "dispatch_key": _class_attr(platform_cls, "dispatch_key"),
            "get_compile_backend": returned("get_compile_backend"),
            "get_static_graph_wrapper_cls": returned("get_static_graph_wrapper_cls"),
            "get_pass_manager_cls": returned("get_pass_manager_cls"),
            "opaque_attention_op": returned("opaque_attention_op"),
            "where": platform.lines(platform_cls),
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", type=Path, required=True, help="unpacked vLLM wheel (the folder holding vllm/)")
    ap.add_argument("--wheel", type=Path, help="the wheel file, for its name and sha256")
    ap.add_argument("--vllm-ascend", type=Path, help="unpacked vLLM-Ascend source (the folder holding vllm_ascend/)")
    ap.add_argument("--vllm-ascend-archive", type=Path, help="the vLLM-Ascend sdist, for its name and sha256")
    ap.add_argument("--out", type=Path, help="default: tests/fixtures/vllm_<version>.json")
    ap.add_argument("--check", type=Path, help="compare with this fixture instead of writing")
    args = ap.parse_args(argv)
    fixture = extract(args.vllm, args.vllm_ascend, args.wheel, args.vllm_ascend_archive)
    text = json.dumps(fixture, indent=1, sort_keys=False) + "\n"
    if args.check:
        old = args.check.read_text()
        if old != text:
            print(f"{args.check}: differs from what {args.vllm} gives", file=sys.stderr)
            return 1
        print(f"{args.check}: up to date")
        return 0
    out = args.out or Path(__file__).resolve().parent.parent / "tests" / "fixtures" / (
        "vllm_" + fixture["source"]["vllm"]["version"].replace(".", "_") + ".json")
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
