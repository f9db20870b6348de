"""The logged model `gat-<dataset>`, as MLflow's models-from-code loads it: node ids in, class log-probabilities out.

train logs this file itself (`mlflow.pyfunc.log_model(python_model=<this file>)`) with three artifacts, the train
stage's `model.pt` (gat.model.model_state), preprocess's `graph.pt` (gat.data.graph_to_tensors) and `dataset.txt`
(the dataset's name, for the messages): plain tensors and text, read back with `torch.load(weights_only=True)`, so
loading the model unpickles no object, unlike MLflow's pytorch flavour with `serialization_format="pickle"` (its pt2
export cannot trace the sparse CSR features). MLflow runs this file in the loading process, with `gat/` from the
model's `code/` on the path: it imports nothing from `stages`.

The input is checked here, not by the signature: an int64 signature makes MLflow's scoring server cast the JSON
before the model sees it (`np.array([1.9], dtype=int64)` is node 1), so a float would be truncated silently.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import set_model
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

from gat.data import graph_from_tensors
from gat.model import NodeClassifier, model_from_state
from gat.training import GraphTensors


class NodeIdError(MlflowException):
    """A request's node ids are not valid: HTTP 400 from the scoring server, with `message` as the whole answer.

    The scoring server rewrites the message of an MlflowException raised in predict into "Failed to predict data
    '<the whole request>'. \\nError: <message>"; this message keeps its one sentence (the setter ignores that)."""

    def __init__(self, sentence: str):
        self._sentence = sentence
        super().__init__(sentence, error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._sentence

    @message.setter
    def message(self, _rewritten: str) -> None:
        pass


def node_ids(model_input: Any, num_nodes: int, dataset: str) -> np.ndarray:
    """`model_input` as an int64 array of node ids, or NodeIdError in one sentence naming the first bad value.

    Valid: a non-empty flat list (or 1-D array, or one-column DataFrame) of integers from 0 to num_nodes - 1.
    A float is refused even when whole (1.0): JSON says 1.0 and 1 apart, and a client sending floats has a bug;
    booleans and strings are refused too."""
    if hasattr(model_input, "to_numpy"):  # a pandas DataFrame of one column, or a Series
        model_input = model_input.to_numpy()
        if model_input.ndim == 2 and model_input.shape[1] == 1:
            model_input = model_input[:, 0]
    if isinstance(model_input, torch.Tensor):
        model_input = model_input.numpy()
    try:
        ids = np.asarray(model_input)
    except ValueError:  # ragged nesting
        ids = np.asarray(None)
    if ids.ndim != 1:
        got = repr(model_input if isinstance(model_input, (list, str, int, float)) else ids.tolist())
    elif ids.size == 0:
        got = "an empty list"
    elif ids.dtype.kind not in "iu":
        got = repr(_first_bad(model_input if isinstance(model_input, list) else ids.tolist()))
    else:
        wrong = ids[(ids < 0) | (ids >= num_nodes)]
        if wrong.size == 0:
            return ids.astype(np.int64)
        got = str(wrong[0])
    if len(got) > 60:
        got = got[:57] + "..."
    raise NodeIdError(f"node ids must be integers from 0 to {num_nodes - 1} ({dataset.capitalize()} has {num_nodes} "
                      f"nodes), in a non-empty list; got {got}")


def _first_bad(values: list) -> Any:
    """The value to name: the served JSON arrives as one numpy array, [1, 2.5] as floats and [1, "a"] as strings,
    so the first that was not a whole number in the request (2.5, "a") comes before the first non-int (1.0)."""
    for value in values:
        if isinstance(value, str) and not value.lstrip("-").isdigit():
            return value
        if isinstance(value, float) and not value.is_integer():
            return value
    return next((value for value in values if isinstance(value, bool) or not isinstance(value, int)), values[0])


class ServedGAT(PythonModel):
    """The trained GAT bound to its graph (gat.model.NodeClassifier): [B] node ids in, [B, C] float32
    log-probabilities out."""

    def load_context(self, context) -> None:
        state = torch.load(context.artifacts["model"], weights_only=True)
        graph = graph_from_tensors(torch.load(context.artifacts["graph"], weights_only=True))
        tensors = GraphTensors.from_graph(graph)
        self.classifier = NodeClassifier(model_from_state(state), tensors.x, tensors.neighbourhoods)
        self.num_nodes = graph.num_nodes
        with open(context.artifacts["dataset"]) as name:
            self.dataset = name.read().strip()

    def predict(self, context, model_input: np.ndarray, params: dict[str, Any] | None = None) -> np.ndarray:
        ids = node_ids(model_input, self.num_nodes, self.dataset)
        return self.classifier(torch.from_numpy(ids)).numpy()


set_model(ServedGAT())
