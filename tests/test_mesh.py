
import pytest

from jaxdist.errors import UsageError
from jaxdist.mesh import MeshShape, hybrid_device_array, parse_mesh
from tests.helpers import FakeGPU


@pytest.mark.parametrize("text, shape", [
    ("4x8", MeshShape(4, 8)),
    ("data:4,fsdp:8", MeshShape(4, 8)),
    ("fsdp:8,data:4", MeshShape(4, 8)),
    ("fsdp:8", MeshShape(1, 8)),
    ("32", MeshShape(32, 1)),
    ("-1", MeshShape(-1, 1)),
    ("2x2x2", MeshShape(2, 2, 2)),
    ("data:1,fsdp:4,tensor:8", MeshShape(1, 4, 8)),
    ("tensor:2,expert:4", MeshShape(1, 1, 2, 4)),
    (" 2X4 ", MeshShape(2, 4)),
])
def test_mesh_forms(text, shape):
    assert parse_mesh(text) == shape


@pytest.mark.parametrize("text, words", [
    ("4x", "axis size ''"),
    ("0x8", "axis size '0'"),
    ("axb", "axis size 'a'"),
    ("4x8x2x9x9x2", "has 6 axes"),  # DATAxFSDPxTENSORxEXPERTxSTAGE at most
    ("pipeline:4", "unknown axis 'pipeline'"),
    ("data:4,model:8", "unknown axis 'model'"),
    ("data:4,data:2", "given twice"),
    ("-2", "axis size '-2'"),
])
def test_mesh_errors_name_the_problem(text, words):
    with pytest.raises(UsageError) as err:
        parse_mesh(text)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_axes_and_labels():
    assert MeshShape(4, 8).axis_sizes == {"data": 4, "fsdp": 8}
    assert MeshShape(1, 4, 8).label == "1x4x8"
    assert MeshShape(2, 1, 1, 4).axis_sizes == {"data": 2, "fsdp": 1, "tensor": 1, "expert": 4}
    assert MeshShape(2, 2, 2, 2).size == 16


def test_minus_one_resolves_to_every_device():
    assert parse_mesh("-1").resolve(32) == MeshShape(32, 1)


def test_fsdp_axis_stays_inside_a_host():
    # 4 hosts x 8 GPUs, listed in a scrambled order as a cluster might report them.
    devices = [FakeGPU(p * 8 + i, p) for i in range(8) for p in (2, 0, 3, 1)]
    array = hybrid_device_array(MeshShape(4, 8), devices)
    assert array.shape == (4, 8)
    for row in array:  # one fsdp group per row: all on one host
        assert len({d.process_index for d in row}) == 1
    assert [row[0].process_index for row in array] == [0, 1, 2, 3]


def test_hsdp_groups_across_hosts_rejected_when_fsdp_spans_hosts():
    devices = [FakeGPU(p * 8 + i, p) for p in range(4) for i in range(8)]
    with pytest.raises(UsageError, match="only data crosses hosts"):
        hybrid_device_array(MeshShape(2, 16), devices)
