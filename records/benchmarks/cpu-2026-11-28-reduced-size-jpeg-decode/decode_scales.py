"""Time one JPEG's decode on the CPU: torchvision.io.decode_jpeg (libjpeg-turbo, full size) against PIL (the same
library) at full size and with draft() at 1/2, 1/4 and 1/8 of the size (libjpeg's DCT scaling), 50 decodes each."""
import io
import time

import numpy as np
import torch
from PIL import Image
from torchvision.io import decode_jpeg

rng = np.random.default_rng(0)
x = np.linspace(0, 1, 500)[None, :, None] * 255 * rng.random((1, 1, 3))
y = np.linspace(0, 1, 375)[:, None, None] * 255
photo = np.clip(x * 0.5 + y * 0.5 + rng.normal(0, 20, (375, 500, 3)), 0, 255).astype(np.uint8)
for w, h in ((500, 375), (1024, 768)):
    buf = io.BytesIO()
    Image.fromarray(photo).resize((w, h)).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def pil(scale=1):
        with Image.open(io.BytesIO(data)) as im:
            if scale > 1:
                im.draft("RGB", (w // scale, h // scale))
            return np.asarray(im.convert("RGB"))

    for name, decode in (("torchvision", lambda: decode_jpeg(encoded)), ("PIL", pil), ("PIL 1/2", lambda: pil(2)),
                         ("PIL 1/4", lambda: pil(4)), ("PIL 1/8", lambda: pil(8))):
        decode()
        t0 = time.perf_counter()
        for _ in range(50):
            out = decode()
        print(f"{w}x{h} {name}: {(time.perf_counter() - t0) / 50 * 1000:.2f} ms, {tuple(out.shape)}")
