"""The fix for a cause, in the words of the framework that wrote the checkpoint (Hugging Face's
Trainer, Accelerate, Lightning), or in plain PyTorch's; and what to say where no fix exists.

The framework is the outermost one on the stack when the checkpoint was saved (the tracer's
`framework`): the Trainer calls Accelerate, and Lightning calls its own Fabric, but the user wrote
against the outer one.
"""

from __future__ import annotations

# exactresume's one line for each framework (exactresume.integrations), named first where it cures the cause.
LIGHTNING_LINE = (
    "add exactresume's callback, Trainer(callbacks=[..., exactresume.lightning_resume()]): the checkpoints "
    "ModelCheckpoint writes then keep the loader's position and the RNG, and fit(ckpt_path=) resumes them exactly"
)
ACCELERATE_LINE = (
    "after prepare(), loader = exactresume.accelerate_resume(accelerator, loader), and iterate it without "
    "skip_first_batches: save_state() then keeps its position and the RNG, and after load_state() it continues "
    "exactly where the loop stopped"
)
TRAINER_LINE = (
    "trainer = exactresume.trainer_resume(Trainer(...)): its checkpoints then keep the loader's position and "
    "the RNG as they were at each fetch, and train(resume_from_checkpoint=True) resumes them exactly"
)

FIXES: dict[tuple[str, str | None], str] = {
    ("data_position_lost", "accelerate"): (
        f"{ACCELERATE_LINE}; "
        "or Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)) and "
        "loader.set_epoch(epoch) as each epoch begins (the loader of skip_first_batches too): the order is then "
        "a function of the seed and the epoch; or DataLoaderConfiguration(use_stateful_dataloader=True) "
        "(torchdata), whose position save_state() and load_state() keep"
    ),
    ("data_position_lost", "lightning"): (
        f"{LIGHTNING_LINE}; "
        "or: Lightning restarts a plain DataLoader from its epoch's first batch after a mid-epoch checkpoint (its "
        "warning: 'your dataloader is not resumable'): give fit() a DataLoader with state_dict() and "
        "load_state_dict(), such as torchdata's StatefulDataLoader, whose state Lightning keeps in the checkpoint; "
        "or checkpoint at epoch ends only, ModelCheckpoint(every_n_epochs=1)"
    ),
    ("data_position_lost", "transformers"): (
        f"{TRAINER_LINE}; "
        "or: the Trainer keeps the order itself (a seedable sampler, and skip_first_batches on resume) unless "
        "TrainingArguments(ignore_data_skip=True) or a DataLoader of your own (a get_train_dataloader override) "
        "draws it: keep that DataLoader's sampler state in the checkpoint"
    ),
    ("data_position_lost", None): (
        "save the sampler's state (its generator's get_state() at the epoch's start, or its epoch) with the "
        "checkpoint and restore it before iterating, then skip the batches already seen"
        "; or, in a loop of your own, wrap the DataLoader in exactresume.ResumableLoader and save it as a part "
        "(docs/loaders.md)"
    ),
    ("generator_behind", None): (
        "give the sampler a generator of its own, apart from the DataLoader's: StatefulDataLoader(data, "
        "sampler=torchdata.stateful_dataloader.sampler.RandomSampler(data, generator=torch.Generator()"
        ".manual_seed(SEED)), generator=torch.Generator().manual_seed(SEED + 1))"
        "; or, in a loop of your own, wrap the loader in exactresume.ResumableLoader and save it as a part "
        "(docs/loaders.md)"
    ),
    ("rng_batches", None): (
        "save torch.get_rng_state() as it stands before the coming batch is drawn (before a prefetch draws it) and "
        "set it back before the resumed run draws its first batch; or draw the batches from a torch.Generator of "
        "their own and save its get_state()"
    ),
    ("stream_position_lost", None): (
        "save ds.state_dict() in the checkpoint and call ds.load_state_dict() on resume, before iterating (with "
        "num_workers > 0, through torchdata's StatefulDataLoader, whose state_dict() holds it); it keeps the "
        "stream's position but not a .shuffle(buffer_size=) buffer's content: for an exact resume, shuffle the "
        "map-style Dataset before to_iterable_dataset() instead"
        "; or save exactresume.ResumableStream(ds) as a part, which resumes a shuffle buffer exactly (docs/loaders.md)"
    ),
    ("shuffle_buffer_lost", None): (
        "datasets does not save a shuffle buffer's content: for an exact resume, drop .shuffle(buffer_size=) on the "
        "stream and shuffle the map-style Dataset before to_iterable_dataset() (Dataset.shuffle(seed=) permutes its "
        "indices, which ds.state_dict() then resumes exactly)"
        "; or save exactresume.ResumableStream(ds) as a part, which resumes a shuffle buffer exactly (docs/loaders.md)"
    ),
    ("stream_rng_lost", None): (
        "save the stream's shuffle generator's get_state() with its position, and set_state() it on resume "
        "before the stream draws"
    ),
    ("forward_module_lost", None): (
        "save that module's state_dict() in the checkpoint and load_state_dict() it on resume (an EMA or averaged "
        "copy: never rebuild it from the resumed weights)"
    ),
    ("buffers_lost", None): (
        "save model.state_dict(), which holds the buffers too, not only its parameters, and load it back with "
        "model.load_state_dict()"
    ),
    ("forward_state", None): "save and restore every module and value the forward reads, not only the trained weights",
    ("optimizer_misplaced", None): (
        "build the optimizer's param groups from the parameters in the same order on resume as when it was saved "
        "(sorted by name, say): optimizer.load_state_dict() matches them by position"
    ),
    ("rng_misplaced", None): (
        "set the RNG state back at the point of the loop it was saved at (after the saved step, before the next "
        "DataLoader iterator is made or batch drawn), or give the DataLoader its own generator=, "
        "DataLoader(..., generator=torch.Generator().manual_seed(SEED)): making its iterator then leaves the "
        "global RNG alone"
    ),
    ("augmentation_unseen", None): (
        "draw the augmentation from a generator seeded by the epoch and the sample's index "
        "(np.random.default_rng((seed, epoch, index)), torch.Generator().manual_seed(...)) in the dataset or "
        "collate function: it is then the same at a resume whichever worker draws it"
    ),
    ("resumed_at_saved_step", None): (
        "start the resumed loop at the step after the saved one: save the number of steps done (the loop's index "
        "+ 1, where it counts from 0) and resume at it, or resume at the saved index + 1"
    ),
    ("epoch_lost", None): "save the epoch and call sampler.set_epoch(epoch) before iterating on resume",
    ("rng_after_iterator", None): (
        "give the DataLoader its own generator, DataLoader(..., generator=torch.Generator().manual_seed(SEED)): "
        "making its iterator then draws from that generator and leaves the global RNG alone; or restore the RNG "
        "after the iterator is made"
    ),
    ("rng_after_iterator", "accelerate"): (
        f"{ACCELERATE_LINE}; "
        "or give the DataLoader you prepare its own generator, DataLoader(..., generator=torch.Generator()"
        ".manual_seed(SEED)): making its iterator (skip_first_batches makes a new one) then leaves the RNG "
        "load_state() restored alone"
    ),
    ("batch_randomness", "transformers"): (
        f"{TRAINER_LINE}; "
        "without it, no TrainingArguments setting changes this: on a mid-epoch resume the Trainer loads "
        "rng_state.pth only after it has fetched the first batch; draw the collator's (or dataset's) randomness from a "
        "torch.Generator seeded by the sample or batch index, not from the global RNG"
    ),
    ("batch_randomness", None): (
        "restore the RNG state before the first batch is drawn, or draw the dataset's or collate_fn's randomness "
        "from a torch.Generator seeded by the sample or batch index"
    ),
    ("rng_lost", "lightning"): (
        f"{LIGHTNING_LINE}; "
        "or: Lightning's checkpoint holds no RNG state and no Trainer flag adds it: save torch.get_rng_state() in the "
        "LightningModule's on_save_checkpoint(checkpoint) and set it back in on_load_checkpoint(checkpoint)"
    ),
    ("scheduler_lost", "accelerate"): (
        "prepare the scheduler with accelerator.prepare(), or accelerator.register_for_checkpointing(scheduler), "
        "so that save_state() keeps it"
    ),
}


def fix_for(cause: str, framework: str | None) -> str | None:
    """The fix for `cause` in `framework`'s words, else in plain PyTorch's, else None."""
    return FIXES.get((cause, framework)) or FIXES.get((cause, None))


def framework_fix(cause: str, framework: str | None) -> str | None:
    """The fix for `cause` only where `framework` has words of its own for it."""
    return FIXES.get((cause, framework)) if framework else None
