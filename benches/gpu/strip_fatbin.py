"""Zero the CUDA kernels of every architecture but one in a shared library's `.nv_fatbin`, so
that the library compresses to what one GPU needs (ONNX Runtime's CUDA provider: 284 MB, of
which 219 MB are kernels for sm_75, 80, 86, 89, 90 and 120; with only sm_90's kept, 52 MB of
xz). The headers stay: the driver still finds every entry and loads only its own
architecture's, so the zeroed ones are never read on that GPU. For the lent H200 only: a
library made this way fails on any other architecture.

    python3 benches/gpu/strip_fatbin.py IN.so OUT.so [ARCH=90]
"""

import struct
import sys

FATBIN_MAGIC = 0xBA55ED50


def section(data: bytes, name: bytes) -> tuple[int, int]:
    """File offset and size of the ELF64 section `name`."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    strtab_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        hdr = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", data, hdr)
        end = data.index(b"\0", strtab_off + name_off)
        if data[strtab_off + name_off:end] == name:
            off, size = struct.unpack_from("<QQ", data, hdr + 0x18)
            return off, size
    raise SystemExit(f"no section {name.decode()}")


def main() -> int:
    src, dst = sys.argv[1], sys.argv[2]
    keep = int(sys.argv[3]) if len(sys.argv) > 3 else 90
    data = bytearray(open(src, "rb").read())
    off, size = section(data, b".nv_fatbin")
    p, end, kept, zeroed = off, off + size, 0, 0
    while p < end:
        magic, _version, header, length = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8  # alignment between containers
            continue
        q, q_end = p + header, p + header + length
        while q < q_end:
            _kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", data, q)
            arch, = struct.unpack_from("<I", data, q + 28)
            if arch == keep:
                kept += payload
            else:
                data[q + entry_header:q + entry_header + payload] = bytes(payload)
                zeroed += payload
            q += entry_header + payload
        p = q_end
    if kept == 0:
        raise SystemExit(f"no sm_{keep} kernels in {src}: nothing would run")
    open(dst, "wb").write(data)
    print(f"sm_{keep}: kept {kept / 1e6:.1f} MB of kernels, zeroed {zeroed / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
