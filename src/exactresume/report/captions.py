"""The figures' captions in Korean, English and Chinese, with numbers from the lab's json files.

`figure_block(folder, name, lang)` is the markdown that embeds one figure (figures.py draws it)
with its caption. Every number comes from compare.json, fp16.json and details/resume_sizes.json,
the same files for every language.
"""

from __future__ import annotations

import json
from pathlib import Path

ALT = {
    "loss_curves": "loss curves",
    "loss_diff": "loss difference",
    "divergence": "weight divergence",
    "sizes": "file sizes",
}

CAPTIONS = {
    "ko": {
        "loss_curves": "그림: 네 실행의 학습 손실. 점선은 {stop_at} 스텝 뒤의 중단 지점입니다. {resumed_on_straight} `noopt`는 스텝마다 최대 {noopt_max_loss_diff:.4f}, `noskip`은 최대 {noskip_max_loss_diff:.4f} 다르지만, 두 곡선 모두 평범한 학습 곡선처럼 보여서 곡선만으로는 재개가 잘못되었다는 것을 알 수 없습니다.",
        "loss_diff": "그림: 스텝별 손실 차이 |loss − straight|(로그 축). 로그 축에는 0이 없으므로 차이가 정확히 0인 스텝은 아래 '= 0 exactly' 줄에 따로 표시했습니다: `resumed`는 {resumed_steps} 스텝 중 {resumed_zero_steps} 스텝에서 정확히 0입니다. {noopt_zero} 손실은 기록된 소수점 6자리 그대로 비교합니다.",
        "divergence": "그림: 재개 후 매 스텝, 같은 프로세스에서 함께 학습한 완전 복원 기준 실행과의 가중치 거리(학습 중 기록). {steps} 스텝에서 `noopt`는 최대 차이 {noopt_max_abs_diff:.3e}, 상대 L2 {noopt_rel_l2:.3e}, `noskip`은 {noskip_max_abs_diff:.3e}, {noskip_rel_l2:.3e}입니다. {resumed_end}",
        "sizes": "그림: `resume.pth` {file_bytes:,} 바이트의 구성 — fp32 가중치 {weights_bytes:,} 바이트({weights_share:.1%}), AdamW 모멘트 {optimizer_moments_bytes:,} 바이트({moments_share:.1%}), 나머지(스텝, 생성기·난수 상태, 설정, 이름) {rest_bytes:,} 바이트. fp32 가중치 파일은 {fp32_bytes:,} 바이트, fp16 파일은 {fp16_bytes:,} 바이트입니다.",
    },
    "en": {
        "loss_curves": "Figure: training loss of the four runs; the dotted line is the stop after step {stop_at}. {resumed_on_straight} `noopt` differs from it by at most {noopt_max_loss_diff:.4f} per step and `noskip` by at most {noskip_max_loss_diff:.4f}, yet both look like ordinary training curves: nothing in the curve alone says the resume went wrong.",
        "loss_diff": "Figure: per-step loss difference |loss − straight| on a log axis. A log axis has no zero, so steps where the difference is exactly 0 are marked in the '= 0 exactly' row below it: `resumed` is exactly 0 at {resumed_zero_steps} of {resumed_steps} steps. {noopt_zero} Losses are compared as logged, to 6 decimals.",
        "divergence": "Figure: weight distance after every resumed step to a fully restored reference run trained alongside in the same process (logged while training). At step {steps}, `noopt` differs by at most {noopt_max_abs_diff:.3e} (relative L2 {noopt_rel_l2:.3e}) and `noskip` by {noskip_max_abs_diff:.3e} ({noskip_rel_l2:.3e}). {resumed_end}",
        "sizes": "Figure: the {file_bytes:,} bytes of `resume.pth`: fp32 weights {weights_bytes:,} ({weights_share:.1%}), AdamW moments {optimizer_moments_bytes:,} ({moments_share:.1%}), the rest (step, generator and RNG states, config, names) {rest_bytes:,}. The fp32 weights file is {fp32_bytes:,} bytes, the fp16 one {fp16_bytes:,}.",
    },
    "zh": {
        "loss_curves": "图：四次运行的训练损失；虚线为第 {stop_at} 步之后的中断点。{resumed_on_straight}`noopt` 每步最多相差 {noopt_max_loss_diff:.4f}，`noskip` 最多相差 {noskip_max_loss_diff:.4f}，但两条曲线看起来都像正常的训练曲线：仅凭曲线看不出续训出了错。",
        "loss_diff": "图：逐步损失差 |loss − straight|（对数轴）。对数轴上没有 0，因此差值恰好为 0 的步单独标在下方 '= 0 exactly' 一行：`resumed` 在 {resumed_steps} 步中有 {resumed_zero_steps} 步恰好为 0。{noopt_zero}损失按记录的 6 位小数比较。",
        "divergence": "图：续训后每一步与在同一进程中并行训练、完整恢复的基准运行之间的权重距离（训练中记录）。第 {steps} 步时，`noopt` 的最大差为 {noopt_max_abs_diff:.3e}（相对 L2 {noopt_rel_l2:.3e}），`noskip` 为 {noskip_max_abs_diff:.3e}（{noskip_rel_l2:.3e}）。{resumed_end}",
        "sizes": "图：`resume.pth` 共 {file_bytes:,} 字节 —— fp32 权重 {weights_bytes:,} 字节（{weights_share:.1%}），AdamW 矩 {optimizer_moments_bytes:,} 字节（{moments_share:.1%}），其余（步数、生成器与随机数状态、配置、名称）{rest_bytes:,} 字节。fp32 权重文件为 {fp32_bytes:,} 字节，fp16 文件为 {fp16_bytes:,} 字节。",
    },
}

# The sentences that hold only for some data: each caption takes the one its numbers make true.
PHRASES = {
    "ko": {
        "on_straight": "`resumed`(동그라미)는 `straight` 위에 정확히 겹칩니다.",
        "off_straight": "`resumed`(동그라미)는 `straight`와 겹치지 않습니다: 스텝마다 손실이 최대 {resumed_max_loss_diff:.3e} 다릅니다.",
        "noopt_zero_first": "`noopt`가 0인 스텝({noopt_zero_steps})은 재개 첫 스텝으로, 그 손실은 첫 갱신 전에 복원된 같은 가중치와 같은 배치로 계산됩니다.",
        "noopt_zero_none": "`noopt`는 어느 스텝에서도 0이 아닙니다.",
        "noopt_zero_other": "`noopt`는 {noopt_zero_steps} 스텝에서 0입니다.",
        "end_zero": "`resumed`의 최종 차이는 {resumed_max_abs_diff:g}이라 로그 축에 그리지 않았습니다.",
        "end_other": "`resumed`의 최종 차이는 {resumed_max_abs_diff:.3e}입니다.",
    },
    "en": {
        "on_straight": "`resumed` (circles) lies exactly on `straight`.",
        "off_straight": "`resumed` (circles) is not on `straight`: its loss differs by up to {resumed_max_loss_diff:.3e} per step.",
        "noopt_zero_first": "`noopt` is 0 at step {noopt_zero_steps}, the first resumed step: its loss is computed before the first update, from the same restored weights and batch.",
        "noopt_zero_none": "`noopt` is 0 at no step.",
        "noopt_zero_other": "`noopt` is 0 at steps {noopt_zero_steps}.",
        "end_zero": "`resumed` ends at distance {resumed_max_abs_diff:g}, which a log axis cannot draw.",
        "end_other": "`resumed` ends at distance {resumed_max_abs_diff:.3e}.",
    },
    "zh": {
        "on_straight": "`resumed`（圆圈）与 `straight` 完全重合。",
        "off_straight": "`resumed`（圆圈）与 `straight` 并不重合：每步损失最多相差 {resumed_max_loss_diff:.3e}。",
        "noopt_zero_first": "`noopt` 为 0 的一步（第 {noopt_zero_steps} 步）是续训第一步：其损失在第一次更新之前、由相同的恢复权重和批次算出。",
        "noopt_zero_none": "`noopt` 没有任何一步为 0。",
        "noopt_zero_other": "`noopt` 在第 {noopt_zero_steps} 步为 0。",
        "end_zero": "`resumed` 的最终距离为 {resumed_max_abs_diff:g}，对数轴无法绘出。",
        "end_other": "`resumed` 的最终距离为 {resumed_max_abs_diff:.3e}。",
    },
}


def _caption_phrases(values: dict, lang: str) -> dict:
    """The data-dependent sentences of `lang`'s captions, chosen by the numbers in `values`."""
    phrases = PHRASES[lang]
    noopt_zero = values["noopt_zero_steps"]
    if noopt_zero == "-":
        zero = "noopt_zero_none"
    else:
        zero = "noopt_zero_first" if noopt_zero == str(values["stop_at"] + 1) else "noopt_zero_other"
    chosen = {
        "resumed_on_straight": "on_straight" if values["resumed_max_loss_diff"] == 0 else "off_straight",
        "noopt_zero": zero,
        "resumed_end": "end_zero" if values["resumed_max_abs_diff"] == 0 else "end_other",
    }
    return {slot: phrases[key].format(**values) for slot, key in chosen.items()}


def caption_values(folder: Path) -> dict:
    """Every number a caption uses, read from the lab's json files."""
    folder = Path(folder)
    compare = json.loads((folder / "compare.json").read_text())
    fp16 = json.loads((folder / "fp16.json").read_text())
    sizes = json.loads((folder / "details" / "resume_sizes.json").read_text())
    runs = compare["runs"]
    resumed_diffs = runs["resumed"]["loss_diffs"]
    values = {
        "stop_at": compare["stop_at"],
        "steps": compare["steps"],
        "resumed_steps": len(resumed_diffs),
        "resumed_zero_steps": sum(d["diff"] == 0 for d in resumed_diffs),
        "resumed_max_abs_diff": runs["resumed"]["max_abs_diff"],
        "resumed_max_loss_diff": runs["resumed"]["max_abs_loss_diff"],
        "noopt_zero_steps": ", ".join(str(d["step"]) for d in runs["noopt"]["loss_diffs"] if d["diff"] == 0) or "-",
        "fp32_bytes": fp16["fp32_bytes"],
        "fp16_bytes": fp16["fp16_bytes"],
        **sizes,
        "weights_share": sizes["weights_bytes"] / sizes["file_bytes"],
        "moments_share": sizes["optimizer_moments_bytes"] / sizes["file_bytes"],
    }
    for name in ("noopt", "noskip"):
        values |= {
            f"{name}_max_abs_diff": runs[name]["max_abs_diff"],
            f"{name}_rel_l2": runs[name]["rel_l2"],
            f"{name}_max_loss_diff": runs[name]["max_abs_loss_diff"],
        }
    return values


def figure_block(folder: Path, name: str, lang: str, prefix: str = "") -> list[str]:
    """Markdown lines: the image (`prefix` + NAME.png, relative to the markdown file), then its caption."""
    values = caption_values(folder)
    caption = CAPTIONS[lang][name].format(**values, **_caption_phrases(values, lang))
    return [f"![{ALT[name]}]({prefix}{name}.png)", "", f"*{caption}*", ""]
