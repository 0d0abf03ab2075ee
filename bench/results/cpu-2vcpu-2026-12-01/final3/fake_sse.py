"""A fake OpenAI streaming server: each POST gets 64 SSE chunks, one per 'step' (20 ms)."""

import asyncio
import json
import sys

CHUNK = {
    "id": "cmpl-0123456789abcdef",
    "object": "text_completion",
    "created": 1764561600,
    "model": "/tmp/m110",
    "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}],
    "usage": None,
}


async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for _i in range(64):
                body = ("data: " + json.dumps(CHUNK) + "\n\n").encode()
                writer.write(b"%x\r\n%s\r\n" % (len(body), body))
                await writer.drain()
                await asyncio.sleep(0.02)
            usage = {
                **CHUNK,
                "choices": [],
                "usage": {"prompt_tokens": 128, "completion_tokens": 64, "total_tokens": 192},
            }
            for body in (("data: " + json.dumps(usage) + "\n\n").encode(), b"data: [DONE]\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(body), body))
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()


asyncio.run(main())
