"""The peer of the overhead bench: the bundled encoder behind a small FastAPI server on
onnxruntime, written the way a home-server user would write one, speaking the same JSON
tensors of the Open Inference Protocol (KServe v2) that vramguard accepts.

    PYTHONPATH=.deps/peer:.deps/onnxruntime python3 benches/peer/server.py --port 8081

One uvicorn worker and one ONNX Runtime intra-op thread, as the bench's vramguard pool has one
worker with one intra-op thread: the two sides get the same inference resources. The handler is
`async def`, so one inference runs at a time on the event loop, as vramguard's one worker runs
one at a time. No batching, no custom JSON decoder: the figure is what the usual stack costs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
DATATYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}


class InputTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[float]


class RequestedOutput(BaseModel):
    name: str


class InferRequest(BaseModel):
    id: str | None = None
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] | None = None


def app_for(model: str, path: Path) -> FastAPI:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    output_names = [o.name for o in session.get_outputs()]
    app = FastAPI()

    @app.get("/v2/health/ready")
    async def ready() -> dict:
        return {"ready": True}

    @app.post(f"/v2/models/{model}/infer")
    async def infer(request: InferRequest) -> dict:
        feeds = {}
        for tensor in request.inputs:
            dtype = DATATYPES.get(tensor.datatype)
            if dtype is None:
                raise HTTPException(400, f"unsupported datatype {tensor.datatype}")
            feeds[tensor.name] = np.asarray(tensor.data, dtype=dtype).reshape(tensor.shape)
        wanted = [o.name for o in request.outputs] if request.outputs else output_names
        try:
            results = session.run(wanted, feeds)
        except Exception as e:  # ONNX Runtime's errors are the client's (bad shape or name)
            raise HTTPException(400, str(e)) from e
        return {
            "model_name": model,
            "id": request.id,
            "outputs": [
                {"name": name, "shape": list(r.shape), "datatype": "FP32", "data": r.ravel().tolist()}
                for name, r in zip(wanted, results)
            ],
        }

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="encoder")
    parser.add_argument("--path", type=Path, default=ROOT / "models" / "encoder.onnx")
    args = parser.parse_args()
    uvicorn.run(app_for(args.model, args.path), host="127.0.0.1", port=args.port, workers=1,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
