"""Quickstart: JSONL -> .bin/.idx -> 90/5/5 split, 0.3/0.7 blend -> GPT -> 2 ranks (DDP + ZeRO-1) -> HF.

python examples/quickstart.py [WORKDIR]        (about 20 s on two CPU cores)
"""
import ast, json, sys, tempfile  # noqa: E401

from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
from tinytron.data import DataConfig, build_data_iterators, build_train_valid_test_datasets, get_batch
from tinytron.data.preprocess import main as tinytron_preprocess, stdlib_corpus
from tinytron.launch import run_on_ranks
from tinytron.model import GPTModel, load_hf_llama, save_hf_llama, tiny_config
from tinytron.optimizer import OptimizerConfig, get_megatron_optimizer
from tinytron.overview.batch import ByteTokenizer
from tinytron.parallel import ParallelGrid

SEQ, MBS, STEPS, TOK = 64, 2, 4, ByteTokenizer()


def train(work: str) -> list[float]:
    """One of the two data-parallel ranks: data, model, DDP, optimizer, STEPS steps, export."""
    grid = ParallelGrid(dp=2)  # run_on_ranks has already joined this process to a 2-rank world
    data = DataConfig(data_path=f"0.3 {work}/prose_text_document 0.7 {work}/code_text_document",
                      split="90,5,5", num_workers=0)
    splits = build_train_valid_test_datasets(data, SEQ, [STEPS * MBS * 2, 8, 8], lambda: True,
                                             eod_id=TOK.eod, pad_id=TOK.pad)
    batches = build_data_iterators(data, splits, [0, 0, 0], MBS, grid)[0]  # this rank's half
    model = GPTModel(tiny_config(seq_length=SEQ))  # same seed on every rank: same weights
    ddp = DistributedDataParallel(model, grid, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    opt = get_megatron_optimizer(OptimizerConfig(lr=3e-3, use_distributed_optimizer=True),
                                 model, grid, ddp=ddp)
    losses = []
    for _ in range(STEPS):  # Megatron's order: zero -> forward/backward -> grad sync -> step
        b = get_batch(batches, grid, micro_batch_size=MBS, seq_length=SEQ, vocab_size=TOK.vocab_size)
        ddp.zero_grad_buffer()
        per_token = ddp(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        loss = (per_token * b["loss_mask"]).sum() / b["loss_mask"].sum()
        loss.backward()
        ddp.finish_grad_sync()  # the grads are now the mean over both ranks (reduce-scatter)
        opt.step()  # each rank updates its half of the weights, then all-gathers them
        losses.append(round(loss.item(), 3))
    save_hf_llama(model, f"{work}/hf")  # every rank calls it; rank 0 writes the folder
    return losses


if __name__ == "__main__":
    work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    sources = [open(f, encoding="utf-8").read() for f in stdlib_corpus(60)[20:60]]  # real text
    corpora = {"code": [s[:20_000] for s in sources],
               "prose": [ast.get_docstring(ast.parse(s)) or "" for s in sources]}
    for name, texts in corpora.items():
        with open(f"{work}/{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        # the shell command: tinytron-preprocess --input WORK/code.jsonl --output-prefix WORK/code
        assert tinytron_preprocess(["--input", f"{work}/{name}.jsonl", "--output-prefix",
                                    f"{work}/{name}", "--workers", "1", "--no-progress"]) == 0
    losses = run_on_ranks(train, 2, work)
    print("loss per step, rank 0 and rank 1:", losses)
    model, config = load_hf_llama(f"{work}/hf")  # also loads with transformers' from_pretrained
    print(f"exported {sum(p.numel() for p in model.parameters()):,} parameters to {work}/hf")
