"""Hugging Face's Trainer as its docs show it: a tiny GPT-2 built from a config, a checkpoint folder
every --save-every steps (save_steps), resumed with trainer.train(resume_from_checkpoint=True).
Exact as written. With --mask-tokens, a data collator masks tokens at random from the torch RNG: on a
mid-epoch resume the Trainer restores the RNG only after it has fetched the first batch, so every
batch after the resume is masked otherwise (a real bug of the Trainer's, not of this script). With --exact,
exactresume's one line, trainer_resume(trainer); --workers sets dataloader_num_workers, --accumulate
gradient_accumulation_steps."""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="out")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--mask-tokens", action="store_true", help="a collator that masks 15%% of the inputs")
parser.add_argument("--exact", action="store_true", help="exactresume's line: trainer_resume(trainer)")
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument(
    "--stream", action="store_true", help="a datasets streaming IterableDataset, shuffle buffer and all"
)
parser.add_argument("--kill-in-save", type=int, help="SIGKILL this process as it writes this step's checkpoint")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)


class Sentences(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (24, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def masking_collator(rows):
    """Token masking as data augmentation: 15% of the inputs replaced by token 0, drawn from the torch RNG."""
    ids = torch.stack([row["input_ids"] for row in rows])
    masked = torch.where(torch.rand(ids.shape) < 0.15, 0, ids)
    return {"input_ids": masked, "labels": ids}


set_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=12, n_embd=16, n_layer=1, n_head=2))
training = TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    save_steps=args.save_every,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    lr_scheduler_type="cosine",
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
    dataloader_num_workers=args.workers,
    gradient_accumulation_steps=args.accumulate,
)
dataset = Sentences()
if args.stream:  # the same rows, streamed from 4 shards through a shuffle buffer of 8
    from datasets import Dataset

    rows = {"input_ids": dataset.ids.tolist(), "labels": dataset.ids.tolist()}
    dataset = (
        Dataset.from_dict(rows).with_format("torch").to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size=8)
    )
trainer = Trainer(
    model=model, args=training, train_dataset=dataset, data_collator=masking_collator if args.mask_tokens else None
)
if args.kill_in_save:  # killed after the model is written, as the optimizer's state is: a folder cut short
    save = torch.save

    def save_or_die(obj, file, *more, **options):
        if f"checkpoint-{args.kill_in_save}" in str(file):
            os.kill(os.getpid(), 9)
        return save(obj, file, *more, **options)

    torch.save = save_or_die
if args.exact:
    from exactresume.integrations.transformers import trainer_resume

    trainer = trainer_resume(trainer)
batches = []
if args.record:
    model.register_forward_pre_hook(
        lambda module, a, kw: batches.append(kw["input_ids"].clone()) if module.training else None, with_kwargs=True
    )
trainer.train(resume_from_checkpoint=True if args.resume else None)
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
