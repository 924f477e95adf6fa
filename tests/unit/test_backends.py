"""Backends with fake device modules: device strings, visible devices, Ray pinning, dtype choices."""

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from flashx_batch.backends import BACKENDS, get_backend, resolve_name
from flashx_batch.backends.base import local_index_for, parse_visible_devices
from flashx_batch.backends.cpu import CpuBackend
from flashx_batch.backends.npu import NpuBackend, soc_has_bf16
from flashx_batch.backends.onnx import choose_providers
from flashx_batch.backends.rocm import RocmBackend, is_hygon_dcu
from flashx_batch.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


class FakeNpu(types.SimpleNamespace):
    """Stands in for `torch.npu` as torch_npu installs it."""

    def __init__(self, name: str = "Ascend910B2", count: int = 8) -> None:
        super().__init__(calls=[])
        self.name, self.count = name, count

    def is_available(self):
        return True

    def device_count(self):
        return self.count

    def get_device_name(self, index=0):
        return self.name

    def set_device(self, index):
        self.calls.append(("set_device", index))

    def synchronize(self):
        self.calls.append(("synchronize",))

    def mem_get_info(self):
        return (1 << 30, 64 << 30)

    def empty_cache(self):
        self.calls.append(("empty_cache",))


@pytest.fixture
def fake_npu(monkeypatch):
    def install(name="Ascend910B2"):
        fake = FakeNpu(name)
        monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
        monkeypatch.setattr(torch, "npu", fake, raising=False)
        return fake
    return install


@pytest.fixture
def fake_rocm(monkeypatch):
    """torch as a HIP build with `name` as device 0 (the cuda API is what HIP torch exposes)."""
    def install(name="AMD Instinct MI300X", arch="gfx942", bf16=True):
        monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(gcnArchName=arch))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    return install


# ---- generic ------------------------------------------------------------------------------------
def test_cpu_backend_and_registry():
    cpu = get_backend("cpu")
    assert isinstance(cpu, CpuBackend) and cpu.device() == torch.device("cpu")
    assert cpu.default_dtype == torch.float32 and cpu.ray_options() == {}
    if not torch.cuda.is_available():  # on a GPU host auto rightly picks the GPU
        assert resolve_name("auto") == "cpu" and get_backend("auto").name == "cpu"
    with pytest.raises(ConfigError, match="unknown; choose one of auto, cpu, cuda, rocm, npu, onnx"):
        get_backend("tpu")
    with pytest.raises(ConfigError, match="doctor runtime.backend=npu"):
        get_backend("npu")


def test_visible_devices_parsing_and_index_mapping():
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == [] and parse_visible_devices("NoDevFiles") == []
    assert parse_visible_devices("2, 3") == ["2", "3"]
    assert local_index_for("3", None) == 3
    assert local_index_for("3", ["2", "3"]) == 1
    with pytest.raises(RuntimeError, match="not in the visible devices"):
        local_index_for("5", ["2", "3"])


@pytest.mark.parametrize("name", ["cpu", "cuda", "rocm", "npu", "onnx"])
def test_is_available_and_describe_never_raise(name):
    cls = BACKENDS[name]
    assert isinstance(cls.is_available(), bool)
    assert cls().describe()["name"] == name


# ---- npu ----------------------------------------------------------------------------------------
def test_npu_with_fake_torch_npu(fake_npu):
    fake = fake_npu("Ascend910B2")
    npu = get_backend("npu")
    assert isinstance(npu, NpuBackend)
    assert npu.device_string(3) == "npu:3" and npu.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert npu.ray_options() == {"resources": {"NPU": 1}}
    assert npu.ray_options({"ascend910b": 1}) == {"resources": {"NPU": 1, "ascend910b": 1}}
    assert npu.default_dtype == torch.bfloat16 and torch.bfloat16 in npu.supported_dtypes
    npu.set_device(2)
    npu.synchronize()
    assert fake.calls == [("set_device", 2), ("synchronize",)]
    assert npu.memory_info() == (1 << 30, 64 << 30)
    assert npu.describe()["devices"] == ["Ascend910B2"] * 8
    assert resolve_name("auto") == "npu"  # npu comes first in auto


@pytest.mark.parametrize("soc,bf16", [("Ascend910B2", True), ("Ascend910_9392", True), ("Ascend910A", False),
                                      ("Ascend910ProB", False), ("Ascend310P3", False)])
def test_npu_dtype_choice_follows_the_soc(fake_npu, soc, bf16):
    fake_npu(soc)
    npu = NpuBackend()
    assert soc_has_bf16(soc) is bf16
    assert npu.default_dtype == (torch.bfloat16 if bf16 else torch.float16)
    assert (torch.bfloat16 in npu.supported_dtypes) is bf16


def test_npu_unavailable_when_torch_npu_import_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError, as without CANN
    assert NpuBackend.is_available() is False
    with pytest.raises(ConfigError, match="torch_npu"):
        get_backend("npu")


def test_npu_respects_ray_noset_visible_devices():
    npu = NpuBackend()
    ids = {"NPU": ["5"]}
    # Ray narrowed ASCEND_RT_VISIBLE_DEVICES to this actor's card: it is device 0.
    assert npu.assigned_device_index(ids, {"ASCEND_RT_VISIBLE_DEVICES": "5"}) == 0
    noset = {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}
    assert npu.assigned_device_index(ids, noset) == 5
    assert npu.assigned_device_index(ids, {**noset, "ASCEND_RT_VISIBLE_DEVICES": "4,5,6"}) == 1
    assert npu.assigned_device_index(None, noset) == 0  # outside Ray


def test_npu_device_object_after_real_style_registration(tmp_path):
    """torch_npu renames PrivateUse1 to `npu` on import; a fake doing the same makes npu:1 a real device."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import torch\ntorch.utils.rename_privateuse1_backend('npu')\n")
    code = textwrap.dedent("""
        from flashx_batch.backends.npu import NpuBackend
        print(NpuBackend().device(1))
    """)
    env_path = f"{tmp_path}:{REPO}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "npu:1"


# ---- rocm / dcu ---------------------------------------------------------------------------------
def test_rocm_with_fake_hip_torch(fake_rocm):
    fake_rocm()
    assert resolve_name("auto") == "rocm"
    rocm = get_backend("rocm")
    assert isinstance(rocm, RocmBackend) and not BACKENDS["cuda"].is_available()  # a HIP build is not CUDA
    assert rocm.device_string(1) == "cuda:1"  # HIP torch exposes devices through the cuda API
    assert rocm.visible_devices_env == "HIP_VISIBLE_DEVICES"
    assert rocm.ray_options() == {"num_gpus": 1.0}
    assert rocm.default_dtype == torch.bfloat16 and not rocm.is_dcu()
    assert rocm.device_name() == "AMD Instinct MI300X (gfx942)"


def test_hygon_dcu_is_named_and_uses_float16(fake_rocm):
    fake_rocm(name="K100_AI", arch="gfx928", bf16=True)
    rocm = get_backend("rocm")
    assert rocm.is_dcu() and rocm.device_name().startswith("Hygon DCU K100_AI")
    assert rocm.default_dtype == torch.float16 and torch.bfloat16 not in rocm.supported_dtypes
    assert is_hygon_dcu("gfx906", {"ROCM_PATH": "/opt/dtk-24.04"})
    assert not is_hygon_dcu("AMD Instinct MI250X", {"ROCM_PATH": "/opt/rocm"})


def test_rocm_visible_devices_and_custom_resource():
    rocm = RocmBackend()
    assert rocm.visible_devices({"HIP_VISIBLE_DEVICES": "0,2", "CUDA_VISIBLE_DEVICES": "1"}) == ["0", "2"]
    # Ray started with --num-gpus on an undetected DCU narrows CUDA_VISIBLE_DEVICES, which HIP honours.
    assert rocm.visible_devices({"CUDA_VISIBLE_DEVICES": "3"}) == ["3"]
    assert rocm.visible_devices({"ROCR_VISIBLE_DEVICES": "3"}) is None  # Ray rejects ROCR: never read
    noset = {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "true", "HIP_VISIBLE_DEVICES": "2,3"}
    assert rocm.assigned_device_index({"GPU": ["3"]}, noset) == 1
    # a DCU Ray does not detect: a custom resource replaces num_gpus, which would never schedule
    assert rocm.ray_options({"DCU": 1}) == {"resources": {"DCU": 1}}


def test_cuda_dtype_falls_back_to_float16_without_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert BACKENDS["cuda"]().default_dtype == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert BACKENDS["cuda"]().default_dtype == torch.bfloat16
    assert BACKENDS["cuda"]().ray_options() == {"num_gpus": 1.0}


# ---- onnx ---------------------------------------------------------------------------------------
def test_onnx_provider_choice():
    assert choose_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert choose_providers(["ROCMExecutionProvider", "MIGraphXExecutionProvider", "CPUExecutionProvider"]) == [
        "MIGraphXExecutionProvider", "ROCMExecutionProvider", "CPUExecutionProvider"]
    onnx = BACKENDS["onnx"]()
    assert onnx.torch_runtime is False and onnx.device() == torch.device("cpu")


def test_onnx_ray_options_follow_the_provider(monkeypatch):
    import flashx_batch.backends.onnx as onnx_mod

    monkeypatch.setattr(onnx_mod, "available_providers", lambda: ["CPUExecutionProvider"])
    assert onnx_mod.OnnxBackend().ray_options() == {}
    monkeypatch.setattr(onnx_mod, "available_providers", lambda: ["MIGraphXExecutionProvider", "CPUExecutionProvider"])
    assert onnx_mod.OnnxBackend().ray_options({"DCU": 1}) == {"num_gpus": 1.0, "resources": {"DCU": 1}}


# ---- hooks the rest of the package asks instead of naming a device --------------------------------
def test_cpu_prepare_model_packs_only_modules_that_opt_in():
    from flashx_batch.backends.cpu import onednn_packs
    from flashx_batch.models.layers import Linear
    from flashx_batch.quant.linear import QuantLinear

    class Unlisted(torch.nn.Module):  # pack() and a float32 weight, but no opt-in
        pack_dtype = torch.float32

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)
            self.calls = 0

        def pack(self):
            self.calls += 1

    def linear(dtype):
        module = Linear(8, 16, bias=False, dtype=dtype, device=torch.device("cpu"))
        torch.nn.init.normal_(module.weight)
        return module

    fp32, bf16, half, unlisted = linear(torch.float32), linear(torch.bfloat16), linear(torch.float16), Unlisted()
    quant = QuantLinear.from_float(torch.randn(8, 16), "fp32", torch.float32)  # a float32 weight, its own kernel
    model = torch.nn.ModuleList([fp32, bf16, half, unlisted, quant])
    packed = CpuBackend().prepare_model(model)
    expected = [m for m, dtype in ((fp32, torch.float32), (bf16, torch.bfloat16)) if onednn_packs(dtype)]
    assert packed == len(expected)  # the quantized linear is not counted: not packed
    assert [m for m in (fp32, bf16, half) if m.packed is not None] == expected
    assert unlisted.calls == 0


def test_graph_capture_is_refused_where_graphs_are_not_wired():
    for backend in (CpuBackend(), RocmBackend(), NpuBackend()):
        assert not backend.supports_graphs
        with pytest.raises(NotImplementedError, match="captures no device graphs"):
            backend.capture_graph(lambda: torch.zeros(1))
    assert issubclass(NotImplementedError, RuntimeError)  # what `DecodeGraphs` treats as a failed capture


def test_for_device_names_the_backend_of_a_device(fake_rocm):
    from flashx_batch.backends import for_device

    assert for_device("cpu").name == "cpu" and for_device(torch.device("cpu")).name == "cpu"
    fake_rocm()
    assert for_device("cuda").name == "rocm" and for_device("cuda:1").name == "rocm"  # a HIP build's `cuda`
    with pytest.raises(ConfigError, match="no available backend runs on device 'npu:0'"):
        for_device("npu:0")


class _Worker:
    """Stands in for a Ray task that resolves `auto` on a worker: records where it was placed."""

    def __init__(self, answer):
        self.answer, self.placed = answer, []

    def __call__(self, options):
        self.placed.append(options)
        return self.answer


@pytest.mark.parametrize(("resources", "extra", "worker_says", "expected", "placed"), [
    ({"CPU": 8}, None, "cuda", "cpu", None),  # nothing but CPUs: no worker asked
    ({"CPU": 8, "GPU": 4}, None, "cuda", "cuda", {"num_gpus": 1.0}),  # NVIDIA: as before
    ({"CPU": 8, "GPU": 4}, None, "rocm", "rocm", {"num_gpus": 1.0}),  # the same resources on AMD GPUs
    ({"CPU": 8, "NPU": 8}, None, "npu", "npu", {"resources": {"NPU": 1}}),
    # a DCU Ray does not detect, offered as a custom resource: asked there, not taken for a CPU node
    ({"CPU": 8, "DCU": 4}, {"DCU": 1}, "rocm", "rocm", {"resources": {"DCU": 1}}),
    ({"CPU": 8, "bigmem": 2}, {"bigmem": 1}, "cpu", "cpu", {"resources": {"bigmem": 1}}),
    ({"CPU": 8, "GPU": 4}, None, None, "rocm", {"num_gpus": 1.0}),  # no answer in time: the first candidate
])
def test_resolve_for_ray_decides_auto_by_the_cluster(resources, extra, worker_says, expected, placed):
    from flashx_batch.backends import resolve_for_ray

    worker = _Worker(worker_says)
    assert resolve_for_ray("auto", resources, extra, worker) == expected
    assert worker.placed == ([] if placed is None else [placed])
    assert resolve_for_ray("npu", resources, extra, worker) == "npu"  # a named backend passes through
    assert len(worker.placed) == (0 if placed is None else 1)


def test_cluster_offers_counts_gpus_and_custom_resources():
    from flashx_batch.backends import cluster_offers

    assert cluster_offers({}, {}) and cluster_offers({"num_cpus": 64}, {"CPU": 1})  # CPUs are the executor's
    assert cluster_offers({"num_gpus": 1.0}, {"GPU": 1}) and not cluster_offers({"num_gpus": 1.0}, {"CPU": 8})
    assert not cluster_offers({"resources": {"NPU": 1, "a2": 1}}, {"NPU": 8})
