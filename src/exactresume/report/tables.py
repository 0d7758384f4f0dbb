"""The ablation table (ablation.json rendered as markdown, in en/ko/zh) and the block of docs/resume-file.md it fills."""

from __future__ import annotations

import json
from pathlib import Path

from exactresume.atomic import atomic_write_bytes
from exactresume.errors import UserError

BEGIN_MARKER, END_MARKER = "<!-- ablation:begin -->", "<!-- ablation:end -->"

TABLE_TEXT = {
    "en": {
        "intro": "Resumed at step {stop_at} of {steps}, each row with one part of the resume file lost; differences are against the same setup's uninterrupted run (`exactresume ablate`).",
        "header": (
            "setup",
            "part",
            "what the resume lost",
            "max abs Δweight",
            "rel. L2 Δweight",
            "Δloss first resumed step",
            "Δloss last step",
            "Δval loss",
            "samples seen twice",
            "samples never seen",
        ),
        "setups": {"base": "as configured", "dropout": "dropout {dropout:g}", "epoch": "epoch loader"},
        "rows": {
            "exact": "nothing (every part restored)",
            "noopt": "optimizer moments and step counters (fresh AdamW)",
            "adam_steps_reset": "AdamW step counters reset to 0, moments kept",
            "noskip": "batch generator reseeded",
            "nostep": "global step (lr schedule restarts)",
            "fp16_weights": "weights stored in fp16",
            "bf16_weights": "weights stored in bf16",
            "norng": "global RNG not restored (dropout masks)",
            "nocursor": "epoch cursor lost (epoch restarts)",
        },
    },
    "ko": {
        "intro": "{steps} 스텝 중 {stop_at} 스텝에서 재개하며 행마다 재개 파일의 한 부분만 잃습니다. 차이는 같은 설정의 중단 없는 실행 대비입니다 (`exactresume ablate`).",
        "header": (
            "설정",
            "부분",
            "재개 때 잃은 것",
            "최대 가중치 차이",
            "상대 L2 차이",
            "재개 첫 스텝 손실 차이",
            "마지막 스텝 손실 차이",
            "검증 손실 차이",
            "두 번 본 샘플",
            "못 본 샘플",
        ),
        "setups": {"base": "기본 설정", "dropout": "드롭아웃 {dropout:g}", "epoch": "에폭 로더"},
        "rows": {
            "exact": "없음 (모든 부분 복원)",
            "noopt": "옵티마이저 모멘트와 step (새 AdamW)",
            "adam_steps_reset": "AdamW step만 0으로, 모멘트는 유지",
            "noskip": "배치 생성기를 초기 시드로",
            "nostep": "전역 스텝 (학습률 스케줄이 처음부터)",
            "fp16_weights": "가중치를 fp16으로 저장",
            "bf16_weights": "가중치를 bf16으로 저장",
            "norng": "전역 난수 상태 미복원 (드롭아웃 마스크)",
            "nocursor": "에폭 커서 손실 (에폭을 처음부터)",
        },
    },
    "zh": {
        "intro": "共 {steps} 步，在第 {stop_at} 步续训，每行只丢失续训文件的一个部分；差值相对于同一设置下未中断的运行（`exactresume ablate`）。",
        "header": (
            "设置",
            "部分",
            "续训时丢失的内容",
            "最大权重差",
            "相对 L2 差",
            "续训第一步损失差",
            "最后一步损失差",
            "验证损失差",
            "看了两次的样本",
            "从未看到的样本",
        ),
        "setups": {"base": "默认设置", "dropout": "dropout {dropout:g}", "epoch": "epoch 加载器"},
        "rows": {
            "exact": "无（恢复所有部分）",
            "noopt": "优化器的矩和 step（新建 AdamW）",
            "adam_steps_reset": "仅 AdamW 的 step 归零，保留矩",
            "noskip": "批次生成器重置为初始种子",
            "nostep": "全局步数（学习率调度从头开始）",
            "fp16_weights": "权重以 fp16 保存",
            "bf16_weights": "权重以 bf16 保存",
            "norng": "未恢复全局随机数状态（dropout 掩码）",
            "nocursor": "丢失 epoch 游标（该 epoch 从头开始）",
        },
    },
}


def _number(value: float, signed: bool = False) -> str:
    if value == 0:
        return "0"
    return f"{value:+.2e}" if signed else f"{value:.2e}"


def render_table(ablation: dict, lang: str = "en") -> list[str]:
    """The ablation table as markdown lines."""
    text = TABLE_TEXT[lang]
    lines = ["| " + " | ".join(text["header"]) + " |", "|" + " --- |" * len(text["header"])]
    for row in ablation["rows"]:
        setup = text["setups"][row["setup"]].format(dropout=ablation["setups"][row["setup"]]["dropout"])
        cells = [
            setup,
            f"`{row['part']}`" if row["part"] else "—",
            text["rows"][row["name"]],
            _number(row["max_abs_diff"]),
            _number(row["rel_l2"]),
            _number(row["first_loss_diff"], True),
            _number(row["final_loss_diff"], True),
            _number(row["val_loss_diff"], True),
            str(row["samples_seen_twice"]),
            str(row["samples_never_seen"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(ablation: dict, lang: str = "en") -> str:
    """The intro sentence and the table."""
    intro = TABLE_TEXT[lang]["intro"].format(stop_at=ablation["stop_at"], steps=ablation["steps"])
    return "\n".join([intro, "", *render_table(ablation, lang)])


def ablation_lines(folder: Path, lang: str) -> list[str]:
    """For the lab report: the table of folder/ablation.json, or nothing when the lab ran no ablation."""
    path = Path(folder) / "ablation.json"
    return ["", render_markdown(json.loads(path.read_text()), lang)] if path.exists() else []


def readme_block(text: str) -> str:
    """What stands between the ablation markers of a page."""
    if BEGIN_MARKER not in text or END_MARKER not in text:
        raise UserError(f"the file has no {BEGIN_MARKER} ... {END_MARKER} block")
    return text.split(BEGIN_MARKER, 1)[1].split(END_MARKER, 1)[0].strip("\n")


def write_readme_block(readme: Path, ablation: dict) -> None:
    """Replace the block between the ablation markers of `readme` with the table of `ablation`."""
    text = readme.read_text()
    readme_block(text)  # refuses a file without the markers
    head, rest = text.split(BEGIN_MARKER, 1)
    tail = rest.split(END_MARKER, 1)[1]
    block = f"{BEGIN_MARKER}\n{render_markdown(ablation)}\n{END_MARKER}"
    atomic_write_bytes(readme, (head + block + tail).encode())
