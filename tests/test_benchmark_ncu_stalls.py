"""benchmarks/ncu_stalls.py on a small source page shaped as ncu writes it (CPU only)."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import ncu_stalls  # noqa: E402

PAGE = '''"Kernel Name","stof_attn"
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_long_sb (Not Issued)"
"0x10","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R12+UR8], R13","0","0","0","0","0"
"0x20","@!P0  BRA 0x80","1,200","1,190","0","1,180","1,170"
"0x30","HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16], RZ, !UPT","300","250","290","0","0"
"0x40","STG.E desc[UR24][R18.64+0x30], R157","500","480","0","20","20"
'''


def test_the_busiest_instructions_come_first_with_the_instructions_before_them(tmp_path):
    page = tmp_path / "kernel.csv"
    page.write_text(PAGE)
    instructions = ncu_stalls.read(page)
    assert [i.opcode for i in instructions] == ["SYNCS", "BRA", "HGMMA", "STG"]  # past the predicate
    assert instructions[1].samples == 1200 and instructions[1].reasons == {"stall_long_sb": 1180}
    text = ncu_stalls.summary(instructions, top=2, context=1)
    assert "2000 samples" in text and "by opcode: BRA 60.0%, STG 25.0%, HGMMA 15.0%" in text
    first, second = text.split("\n\n")[1:3]
    assert first.startswith(" 60.0%  0x20") and "stall_long_sb 1180" in first and "TRYWAIT" in first  # the wait it loops on
    assert second.startswith(" 25.0%  0x40")


def test_a_page_without_stall_sampling_is_named(tmp_path):
    page = tmp_path / "kernel.csv"
    page.write_text('"Address","Source"\n"0x10","NOP"\n')
    with pytest.raises(SystemExit, match="SourceCounters"):
        ncu_stalls.read(page)
