"""report.md: what the lab measured, in Korean (default), English or Chinese.

Every number comes from the json files and logs the lab wrote; the three section headings stay
Korean in every language, as the user's specification asks. The figures (figures.py) sit beside
report.md and are embedded with their captions (captions.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from exactresume.atomic import atomic_write_bytes
from exactresume.report.captions import figure_block
from exactresume.report.tables import ablation_lines

HEADINGS = ("## 무엇을 저장하나", "## 빠뜨리면", "## 반정밀도")

TEXT = {
    "ko": {
        "title": "# 재개 실험 보고서 ({steps} 스텝, {stop_at} 스텝에서 중단)",
        "save_intro": "재개 파일 `resume.pth`는 이어서 학습하는 데 필요한 모든 것을 담습니다:",
        "parts": [
            "`model` — fp32 가중치 (반올림하지 않음): 학습된 값 그대로",
            "`optimizer` — AdamW의 두 모멘트(exp_avg, exp_avg_sq)와 파라미터별 step: 재개 직후의 보폭",
            "`step` — 전역 스텝: 학습률 스케줄은 전역 스텝과 전체 스텝 수의 순수 함수",
            "`gen_state` — 배치 생성기 상태: 다음에 뽑을 배치",
            "`rng` — torch, numpy, python 난수 상태: 드롭아웃 등 모든 무작위 추출",
            "`config` — 모델·학습 설정과 데이터 지문: 다른 실행을 조용히 이어받지 않도록",
        ],
        "resumed": "새 프로세스에서 재개한 결과(`resumed.pth`)와 한 번에 학습한 결과(`straight.pth`)의 최대 텐서 차이는 **{max_abs_diff:g}**이고, {first}–{steps} 스텝의 손실 기록은 글자 그대로 {equal}.",
        "resumed_bits": "새 프로세스에서 재개한 결과(`resumed.pth`)는 한 번에 학습한 결과(`straight.pth`)와 비트 단위로 같고(최대 텐서 차이 **{max_abs_diff:g}**), {first}–{steps} 스텝의 손실 기록은 글자 그대로 {equal}.",
        "omit_none": "한 부분만 빼고 재개해도 여기서는 가중치가 달라지지 않았습니다 (기준: `straight.pth`):",
        "equal_yes": "같습니다",
        "equal_no": "다릅니다",
        "optim": "옵티마이저 상태 원소 수는 {optimizer_numel:,}개, 가중치 원소 수(공유된 lm_head.weight 제외)는 {model_numel:,}개로, 비율은 **{ratio:.3f}**입니다. 그래서 재개 파일({resume_bytes:,} 바이트)은 가중치 파일({fp32_bytes:,} 바이트)의 약 {file_ratio:.2f}배입니다.",
        "omit_intro": "한 부분만 빼고 재개하면 오류 없이 결과가 달라집니다 (기준: `straight.pth`):",
        "omit_row": "`{name}` — 최대 가중치 차이 {max_abs_diff:.3e}, 상대 L2 차이 {rel_l2:.3e}, 재개 첫 스텝 손실 차이 {first_resumed_loss_diff:+.6f}, 마지막 손실 차이 {final_loss_diff:+.6f}",
        "noopt": "옵티마이저 상태를 버리면(`noopt`) AdamW의 기억이 0에서 다시 시작해 재개 직후 스텝들이 전혀 다른 크기로 움직입니다.",
        "noskip": "배치 생성기를 초기 시드로 되돌리면(`noskip`) {stop_at} 스텝 이후의 배치 {seen_twice}개를 이미 본 배치로 다시 보고, 원래 볼 배치 {never}개는 보지 못합니다.",
        "subtle": "손실 곡선으로는 잘 드러나지 않는 차이이므로, 텐서를 직접 비교해야 합니다.",
        "half": "`straight.pth`를 반정밀도로 저장한 `straight_fp16.pth`는 {fp16_bytes:,} 바이트로, fp32 파일 {fp32_bytes:,} 바이트의 {size_ratio:.3f}배입니다. val.npy 앞 128 토큰에서 로짓의 최대 절대 차이는 {max_logit_diff:.3e}입니다.",
        "split": "추론용 가중치(fp16/bf16, 가중치만)와 재개용 가중치(fp32 가중치 + 옵티마이저 + 스텝 + 생성기 상태)는 따로 저장합니다: 앞의 것은 작게, 뒤의 것은 정확하게.",
    },
    "en": {
        "title": "# Resume lab report ({steps} steps, stopped at step {stop_at})",
        "save_intro": "The resume file `resume.pth` holds everything needed to continue training:",
        "parts": [
            "`model` — fp32 weights, never rounded: the trained values as they are",
            "`optimizer` — AdamW's two moments (exp_avg, exp_avg_sq) and per-parameter step: the step sizes right after resuming",
            "`step` — the global step: the lr schedule is a pure function of it and the run's total",
            "`gen_state` — the batch generator's state: the next batch to draw",
            "`rng` — torch, numpy and python RNG states: dropout and every other random draw",
            "`config` — model and training config and the data fingerprint: so a different run is never resumed silently",
        ],
        "resumed": "Resumed in a new process, `resumed.pth` differs from the uninterrupted `straight.pth` by at most **{max_abs_diff:g}** in any tensor, and the loss rows of steps {first}–{steps} are {equal} as text.",
        "resumed_bits": "Resumed in a new process, `resumed.pth` is bit for bit identical to the uninterrupted `straight.pth` (largest difference in any tensor **{max_abs_diff:g}**), and the loss rows of steps {first}–{steps} are {equal} as text.",
        "omit_none": "Resuming with one part left out changed no weight here (reference: `straight.pth`):",
        "equal_yes": "identical",
        "equal_no": "not identical",
        "optim": "The optimizer state holds {optimizer_numel:,} elements, the weights {model_numel:,} (without the tied lm_head.weight): a ratio of **{ratio:.3f}**. That is why the resume file ({resume_bytes:,} bytes) is about {file_ratio:.2f}× the weights file ({fp32_bytes:,} bytes).",
        "omit_intro": "Resuming with one part left out changes the result without any error (reference: `straight.pth`):",
        "omit_row": "`{name}` — max weight difference {max_abs_diff:.3e}, relative L2 difference {rel_l2:.3e}, loss difference at the first resumed step {first_resumed_loss_diff:+.6f}, at the end {final_loss_diff:+.6f}",
        "noopt": "Without the optimizer state (`noopt`), AdamW's memory restarts from zero and the first steps after resuming move at entirely different sizes.",
        "noskip": "With the batch generator reset to the initial seed (`noskip`), {seen_twice} of the batches after step {stop_at} repeat batches already trained on, and {never} batches the run should have seen are never seen.",
        "subtle": "The loss curve barely shows these differences; compare the tensors.",
        "half": "`straight_fp16.pth`, `straight.pth` in half precision, is {fp16_bytes:,} bytes against {fp32_bytes:,} bytes in fp32 ({size_ratio:.3f}×). On the first 128 tokens of val.npy the logits differ by at most {max_logit_diff:.3e}.",
        "split": "Keep weights for inference (fp16/bf16, weights only) apart from weights for resuming (fp32 weights + optimizer + step + generator state): the first small, the second exact.",
    },
    "zh": {
        "title": "# 断点续训实验报告（共 {steps} 步，在第 {stop_at} 步中断）",
        "save_intro": "续训文件 `resume.pth` 保存继续训练所需的一切：",
        "parts": [
            "`model` — fp32 权重，从不舍入：训练出的原值",
            "`optimizer` — AdamW 的两个矩（exp_avg、exp_avg_sq）和每个参数的 step：续训后最初几步的步长",
            "`step` — 全局步数：学习率调度是它与总步数的纯函数",
            "`gen_state` — 批次生成器的状态：下一个要抽取的批次",
            "`rng` — torch、numpy、python 的随机数状态：dropout 及其他一切随机抽取",
            "`config` — 模型与训练配置及数据指纹：不会悄悄续训另一个运行",
        ],
        "resumed": "在新进程中续训得到的 `resumed.pth` 与一次训练完成的 `straight.pth` 的最大张量差为 **{max_abs_diff:g}**，第 {first}–{steps} 步的损失记录逐字{equal}。",
        "resumed_bits": "在新进程中续训得到的 `resumed.pth` 与一次训练完成的 `straight.pth` 逐位相同（最大张量差 **{max_abs_diff:g}**），第 {first}–{steps} 步的损失记录逐字{equal}。",
        "omit_none": "只少恢复一个部分，这里的权重也没有改变（基准：`straight.pth`）：",
        "equal_yes": "相同",
        "equal_no": "不同",
        "optim": "优化器状态共 {optimizer_numel:,} 个元素，权重（不含共享的 lm_head.weight）共 {model_numel:,} 个，比值为 **{ratio:.3f}**。因此续训文件（{resume_bytes:,} 字节）约为权重文件（{fp32_bytes:,} 字节）的 {file_ratio:.2f} 倍。",
        "omit_intro": "只少恢复一个部分，结果就会在没有任何报错的情况下改变（基准：`straight.pth`）：",
        "omit_row": "`{name}` — 最大权重差 {max_abs_diff:.3e}，相对 L2 差 {rel_l2:.3e}，续训第一步损失差 {first_resumed_loss_diff:+.6f}，最终损失差 {final_loss_diff:+.6f}",
        "noopt": "丢掉优化器状态（`noopt`）后，AdamW 的记忆从 0 重新开始，续训后最初几步的步长完全不同。",
        "noskip": "把批次生成器重置为初始种子（`noskip`）后，第 {stop_at} 步之后有 {seen_twice} 个批次是已经训练过的批次，本应看到的 {never} 个批次则从未看到。",
        "subtle": "这些差异在损失曲线上几乎看不出来，必须直接比较张量。",
        "half": "以半精度保存的 `straight_fp16.pth` 为 {fp16_bytes:,} 字节，fp32 文件为 {fp32_bytes:,} 字节（{size_ratio:.3f} 倍）。在 val.npy 前 128 个 token 上，logits 的最大绝对差为 {max_logit_diff:.3e}。",
        "split": "推理用权重（fp16/bf16，仅权重）与续训用权重（fp32 权重 + 优化器 + 步数 + 生成器状态）分开保存：前者求小，后者求准。",
    },
}


def _read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def render_report(folder: Path, lang: str = "ko") -> str:
    """The report's markdown, from fp16.json, optim.json, compare.json and the files' sizes."""
    text = TEXT[lang]
    fp16, optim, compare = _read(folder, "fp16.json"), _read(folder, "optim.json"), _read(folder, "compare.json")
    runs, k, steps = compare["runs"], compare["stop_at"], compare["steps"]
    resume_bytes = (folder / "resume.pth").stat().st_size
    resumed = runs["resumed"]
    lines = [text["title"].format(steps=steps, stop_at=k), "", HEADINGS[0], "", text["save_intro"], ""]
    lines += [f"- {part}" for part in text["parts"]]
    lines += [
        "",
        text["resumed_bits" if resumed.get("bits_equal") else "resumed"].format(
            max_abs_diff=resumed["max_abs_diff"],
            first=k + 1,
            steps=steps,
            equal=text["equal_yes" if resumed["log_rows_equal"] else "equal_no"],
        ),
        "",
        text["optim"].format(
            **optim,
            resume_bytes=resume_bytes,
            fp32_bytes=fp16["fp32_bytes"],
            file_ratio=resume_bytes / fp16["fp32_bytes"],
        ),
        "",
    ]
    lines += figure_block(folder, "sizes", lang)
    changed = any(runs[name]["max_abs_diff"] != 0 for name in ("noopt", "noskip"))
    lines += [HEADINGS[1], "", text["omit_intro" if changed else "omit_none"], ""]
    lines += ["- " + text["omit_row"].format(name=name, **runs[name]) for name in ("resumed", "noopt", "noskip")]
    noskip = runs["noskip"]
    lines += [
        "",
        text["noopt"],
        "",
        text["noskip"].format(stop_at=k, seen_twice=noskip["batches_seen_twice"], never=noskip["batches_never_seen"]),
        "",
        text["subtle"],
        *ablation_lines(folder, lang),
        "",
    ]
    for name in ("loss_curves", "loss_diff", "divergence"):
        lines += figure_block(folder, name, lang)
    lines += [HEADINGS[2], "", text["half"].format(**fp16), "", text["split"], ""]
    return "\n".join(lines)


def write_report(folder: Path, lang: str = "ko") -> Path:
    """Write folder/report.md atomically; returns its path."""
    path = Path(folder) / "report.md"
    atomic_write_bytes(path, render_report(Path(folder), lang).encode())
    return path
