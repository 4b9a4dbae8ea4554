"""Is a cubin whole? A cubin is a little-endian ELF64 file; it is whole when its header, its section-header and
program-header tables, every section with contents in the file and every segment lie inside the file, and the
file ends exactly where the last of them ends. A cubin cut short (CuPy's getCUBIN drops the last byte) or padded
fails here, on the CPU, instead of in cuModuleLoad on a GPU.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("<16sHHIQQQIHHHHHH")  # Elf64_Ehdr: 64 bytes
SECTION = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr: 64 bytes
SEGMENT = struct.Struct("<IIQQQQQQ")  # Elf64_Phdr: 56 bytes
SHT_NOBITS = 8  # a section that takes no room in the file (.bss, .nv.shared.*)


def extents(data: bytes) -> list[tuple[str, int, int]]:
    """(what, offset, end) of every part of the file that an ELF loader reads; a ValueError where the header
    itself is missing or not ELF64 little-endian. Entries of a table that runs past the file are left out (the
    table's own extent already says so)."""
    if len(data) < HEADER.size or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"not a little-endian ELF64 file ({len(data)} bytes, starting {data[:6]!r})")
    (_, _, _, _, _, phoff, shoff, _, ehsize, phentsize, phnum, shentsize, shnum, _) = HEADER.unpack_from(data)
    found = [("ELF header", 0, ehsize),
             ("section-header table", shoff, shoff + shnum * shentsize),
             ("program-header table", phoff, phoff + phnum * phentsize)]
    for i in range(shnum):
        at = shoff + i * shentsize
        if shentsize >= SECTION.size and at + SECTION.size <= len(data):
            _, kind, _, _, offset, size, *_ = SECTION.unpack_from(data, at)
            if kind != SHT_NOBITS and size:
                found.append((f"section {i}", offset, offset + size))
    for i in range(phnum):
        at = phoff + i * phentsize
        if phentsize >= SEGMENT.size and at + SEGMENT.size <= len(data):
            _, _, offset, _, _, filesz, _, _ = SEGMENT.unpack_from(data, at)
            if filesz:
                found.append((f"segment {i}", offset, offset + filesz))
    return found


def problems(data: bytes) -> list[str]:
    """What keeps `data` from being a whole ELF file, one line each; empty when it is whole."""
    try:
        parts = extents(data)
    except ValueError as exc:
        return [str(exc)]
    size = len(data)
    found = [f"{what} [{start}, {end}) runs past the end of the file ({size} bytes)"
             for what, start, end in parts if end > size]
    last = max(end for _, _, end in parts)
    if last < size:
        found.append(f"the file ({size} bytes) goes on past its last part, which ends at {last}")
    return found
