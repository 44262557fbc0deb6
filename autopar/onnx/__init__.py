"""Annotated ONNX export: the model's inference graph, with the plan in ONNX's own multi-device fields.

A plan is worth carrying beyond autopar's runtime: an ONNX consumer (a
serving stack, a graph compiler, a reviewer) can read which tensors are
split over which devices without knowing autopar. ONNX (IR version 11) has
fields for exactly that, and ``onnx.checker`` does not look inside them, so
this package writes them (``export.py``), and reads and checks them
(``annotations.py``):

- ``ModelProto.configuration``: one ``DeviceConfigurationProto`` named
  "autopar" with ``num_devices`` = the plan's world size (dp x tp x pp) and
  one device name per rank. Rank of mesh coordinate (stage, d, t) is
  ``(stage * dp + d) * tp + t``: tp innermost, as the runtime lays out its
  mesh, pp outermost.
- ``NodeProto.device_configurations``: on every node that reads or writes an
  annotated tensor, one ``ShardingSpecProto`` per such tensor. Each tensor
  axis that mesh axes split gets a ``ShardedDimProto`` with one
  ``SimpleShardedDimProto`` (``num_shards`` = the product of those mesh axis
  sizes; an axis split by both dp and tp is split dp-major, as DTensor
  does). ``device`` has one entry per shard, in row-major order over the
  sharded axes; a shard held by several devices is a group key (>=
  ``num_devices``) expanded in ``index_to_device_group_map``. A tensor has
  one layout, wherever it is mentioned: a node's input spec is the layout
  its producer leaves it in (resharding to what the op wants is the
  runtime's business, as in the plan). ``pipeline_stage`` is set where the
  plan has stages.
- Partial values ("P", "P(avg)", ...) have no ONNX form. They are written
  as replicated on that mesh axis -- the layout of the *full* value, which
  an ONNX runtime obtains by reducing -- and the exact placement is kept in
  the node's ``metadata_props["autopar.sharding"]`` (JSON: tensor ->
  placements and the plan node they came from), which ``read_onnx_plan``
  returns once it has checked that it agrees with the ONNX spec.
- ``ModelProto.metadata_props["autopar.plan"]``: the whole plan as JSON.

What is annotated: every initializer holding a planned parameter or buffer
(tied weights under whichever name the exporter kept), every graph input
that is a planned input, and every tensor computed by an exported op that
pairs with a forward op of the plan's joint graph: same module path, same
kind of op (``linear`` pairs with ``mm``/``addmm``, ``layer_norm`` with
``native_layer_norm``, ``scaled_dot_product_attention`` with the fused
attention kernels, other ops by ATen name), same position among the ops of
that kind in that module, same shape (where the joint graph flattened a
``linear`` to 2-D, the view back to the output's shape stands for it). A
module whose ops of one kind do not pair one to one is left out for that
kind rather than guessed. Not annotated: tensors only the ONNX graph has
(constants, shape arithmetic, the pieces an op is lowered into, such as the
transposed weight of a ``linear``), the loss and the backward (the export is
an inference graph), and any op when the plan has no per-op placements (a
plan the data-parallel model chose).
"""

from autopar.onnx.annotations import OnnxError, OnnxPlan, read_onnx_plan, validate_onnx_plan
from autopar.onnx.export import export_onnx

__all__ = ["OnnxError", "OnnxPlan", "export_onnx", "read_onnx_plan", "validate_onnx_plan"]
