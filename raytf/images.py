"""What an encoded image is, from its header alone: format, height, width, channels. Pure Python (no
TensorFlow, no Pillow), so the driver and `raytf data inspect` can check image columns in milliseconds."""
from __future__ import annotations

import dataclasses
import struct

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_CHANNELS = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}  # colour type -> channels (3: palette, decoded as RGB)
JPEG_START_OF_FRAME = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


@dataclasses.dataclass(frozen=True)
class ImageHeader:
    format: str  # "png" or "jpeg"
    height: int
    width: int
    channels: int

    def describe(self) -> str:
        return f"{self.format} {self.height}x{self.width}x{self.channels}"


def header(data: bytes) -> ImageHeader | None:
    """The header of a PNG or JPEG image; None for anything else (or a truncated one)."""
    if data.startswith(PNG_SIGNATURE) and len(data) >= 26 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return ImageHeader("png", height, width, PNG_CHANNELS.get(data[25], 3))
    if data.startswith(b"\xff\xd8"):
        return _jpeg_header(data)
    return None


def _jpeg_header(data: bytes) -> ImageHeader | None:
    """Walk the JPEG markers to the first start-of-frame, which holds the size and the component count."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if marker in JPEG_START_OF_FRAME:
            if i + 10 > len(data):
                return None
            height, width = struct.unpack(">HH", data[i + 5:i + 9])
            return ImageHeader("jpeg", height, width, data[i + 9])
        i += 2 + length
    return None
