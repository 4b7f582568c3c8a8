"""EngineClient: a finished item its reader had taken all before is not a stalled reader's backlog, whatever its size."""

import asyncio

from kda_rt.server.engine_client import DeltaQueue, EngineClient, StreamBacklogError


def test_a_final_item_over_the_bound_whose_reader_keeps_up():
    async def main():
        c = EngineClient({}, max_stream_backlog=100)
        c._send = lambda msg: None
        q = DeltaQueue()
        c.queues["r"] = q
        c._engine_ids["r"] = "e"
        c._request_ids["e"] = "r"
        # a beam search's answer: one finished item, e.g. 8 beams x 20 tokens (reader has taken everything before)
        item = {"id": "e", "finished": True, "outputs": [
            {"index": k, "text": "", "token_ids": [1] * 20, "logprobs": None, "finish_reason": "length",
             "stop_reason": None} for k in range(8)]}
        c._dispatch({"op": "outs", "items": [item]})
        return q.get_nowait()
    got = asyncio.run(main())
    assert not isinstance(got, StreamBacklogError), got
