"""The OPD learning signal without engines, Ray or the async trainer: the default opd
job's student and teachers (the same cached builds) in one process, trained on-policy
with plain PyTorch, next to supervised fine-tuning on the ground truth (the baseline:
what the same student learns from the same prompts when it is told the answers).

Arms, each from the same warm-started student, same prompts per update, same AdamW:
- `sft`: cross-entropy on the ground-truth answer (+ end of turn);
- `k1`: the OPD loss, advantage -(log pi_s - log pi_t) per sampled token, token mean;
- `k1-centred`: the same minus its token mean over the update's batch (the job's
  `distillation.advantage=k1_centred`);
- `k1-clip`: k1 clamped at `-clip`; `k1-clip-centred`: clamped to [-clip, clip], centred;
- `prob`: a bounded advantage, p_teacher - p_student of the sampled token;
- `exact`: the full-vocabulary reverse KL at the sampled prefixes (no engine gives the
  job this; the ceiling of the per-token signal);
- `topk-fkl`: forward KL to the teacher's top-`--topk` log-probs at the sampled prefixes
  (what an engine's top-k prompt log-probs give), the teacher's top-k renormalised.
`--warm-steps` / `--warm-lr` change the student's warm start (cached like the job's).
Printed per arm every `--every` updates: reverse KL per task (token mean, on the
update's samples), the share of sampled tokens the teacher gives < e^-16 ("garbage"),
greedy validation reward per task, and /proc/loadavg.

    uv run --frozen --no-sync python benchmarks/opd_signal_offline.py [--updates 60] [--lr 1e-3]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per update")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--arms", default="sft,k1,k1-centred")
    ap.add_argument("--warm-steps", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--warm-lr", type=float, default=None, help="default: the recipe's")
    ap.add_argument("--clip", type=float, default=5.0, help="k1-clip: advantages >= -clip")
    ap.add_argument("--topk", type=int, default=20, help="topk-fkl: teacher log-probs kept")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from offbeat.core.cli import load_recipe_config
    from offbeat.core.distill.build import build_teacher, write_mixed_task_files
    from offbeat.core.models.resolve import resolve_model
    from offbeat.core.rewards.scorers import char_match, math_answer
    from offbeat.core.tasks import read_parquet
    from offbeat.core.trainer.agent_loop import encode_prompt
    from offbeat.core.trainer.warm_start import warm_start

    overrides = [
        f"warm_start.{k}={v}"
        for k, v in (("steps", args.warm_steps), ("lr", args.warm_lr))
        if v is not None
    ]
    _, cfg = load_recipe_config("opd", overrides)
    d = cfg.distillation
    from offbeat.core.models import cache_root

    cache = cache_root()
    train_f, val_f = write_mixed_task_files(list(d.tasks), cache / "tasks")
    train = [r for f in train_f for r in read_parquet(f)]
    val = [r for f in val_f for r in read_parquet(f)]
    student_dir = warm_start(
        resolve_model(cfg.model.path, cache / "models"),
        train,
        cfg.warm_start,
        cache_dir=cache / "warm_start",
        prompt_key=cfg.data.prompt_key,
    )  # fmt: skip  (the job's own warm start: a cache hit after one `offbeat run opd`)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)  # noqa: E731
    teachers = {n: load(build_teacher(t, cache)).eval() for n, t in d.teachers.items()}
    tok = AutoTokenizer.from_pretrained(student_dir)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    width = cfg.rollout.max_tokens

    def reward(row, text):
        fn = math_answer if row["data_source"] == "math" else char_match
        return fn(text, row["ground_truth"])

    def left_pad(seqs):
        w = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), w), pad)
        mask = torch.zeros((len(seqs), w), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, w - len(s) :], mask[i, w - len(s) :] = torch.tensor(s), 1
        return ids, mask

    def logits(model, ids, mask):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()

    @torch.no_grad()
    def sample(model, prompts, greedy):
        ids, mask = left_pad(prompts)
        done = torch.zeros(len(prompts), dtype=torch.bool)
        rmask = []
        for _ in range(width):
            lg = logits(model, ids, mask)[:, -1]
            nxt = lg.argmax(-1) if greedy else torch.distributions.Categorical(logits=lg).sample()
            rmask.append((~done).long())
            done = done | (nxt == eos)
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], 1)
        return ids, mask, torch.stack(rmask, 1)

    def token_lp(model, ids, mask, r):  # log-prob of each of the last r tokens
        lg = logits(model, ids, mask)[:, -(r + 1) : -1]
        return torch.log_softmax(lg, -1).gather(-1, ids[:, -r:, None])[..., 0]

    def evaluate(model):
        prompts = [encode_prompt(tok, r["prompt"]) for r in val]
        ids, _, rmask = sample(model.eval(), prompts, True)
        by: dict[str, list[float]] = {}
        for r, toks, m in zip(val, ids[:, -width:].tolist(), rmask.tolist(), strict=True):
            text = tok.decode(
                [t for t, k in zip(toks, m, strict=True) if k], skip_special_tokens=True
            )
            by.setdefault(r["data_source"], []).append(reward(r, text))
        return {k: round(sum(v) / len(v), 3) for k, v in sorted(by.items())}

    print(f"student {student_dir}; loadavg {loadavg()}")
    for name, m in teachers.items():
        print(f"teacher {name}: val {evaluate(m)}")
    for arm in args.arms.split(","):
        torch.manual_seed(0)
        rng = random.Random(0)
        student = load(student_dir)
        opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
        print(f"\n== {arm} (lr {args.lr}, {args.prompts} prompts x {args.n} per update)")
        print(f"update 0: val {evaluate(student)}")
        for u in range(1, args.updates + 1):
            rows = [r for r in rng.sample(train, args.prompts) for _ in range(args.n)]
            prompts = [encode_prompt(tok, r["prompt"]) for r in rows]
            ids, mask, rmask = sample(student.eval(), prompts, False)
            m = rmask.float()
            with torch.no_grad():
                t_lp = torch.zeros(m.shape)
                t_full = None
                for name, teacher in teachers.items():
                    sel = torch.tensor([r[d.teacher_key] == name for r in rows])
                    if sel.any():
                        t_lp[sel] = token_lp(teacher, ids[sel], mask[sel], width)
                        if arm in ("exact", "topk-fkl"):
                            full = torch.log_softmax(
                                logits(teacher, ids[sel], mask[sel])[:, -(width + 1) : -1], -1
                            )
                            if t_full is None:
                                t_full = torch.zeros((len(rows), width, full.shape[-1]))
                            t_full[sel] = full
            student.train()
            if arm == "sft":
                answers = [
                    [*tok.encode(r["ground_truth"], add_special_tokens=False), eos] for r in rows
                ]
                sids, smask = left_pad([p + a for p, a in zip(prompts, answers, strict=True)])
                lp = torch.log_softmax(logits(student, sids, smask)[:, :-1], -1)
                lp = lp.gather(-1, sids[:, 1:, None])[..., 0]
                am = torch.zeros_like(lp)
                for i, a in enumerate(answers):
                    am[i, -len(a) :] = 1
                loss = -(lp * am).sum() / am.sum()
                s_lp = token_lp(student, ids, mask, width).detach()
            elif arm == "topk-fkl":  # forward KL to the teacher's top-k at the sampled prefixes
                full = torch.log_softmax(logits(student, ids, mask)[:, -(width + 1) : -1], -1)
                t_top, t_idx = t_full.topk(args.topk, -1)
                t_p = torch.softmax(t_top, -1)  # renormalised over the top-k
                ce = -(t_p * full.gather(-1, t_idx)).sum(-1)
                loss = (ce * m).sum() / m.sum()
                s_lp = full.gather(-1, ids[:, -width:, None])[..., 0].detach()
            elif arm == "exact":  # full-vocabulary reverse KL at the sampled prefixes
                full = torch.log_softmax(logits(student, ids, mask)[:, -(width + 1) : -1], -1)
                kl = (full.exp() * (full - t_full)).sum(-1)
                loss = (kl * m).sum() / m.sum()
                s_lp = full.gather(-1, ids[:, -width:, None])[..., 0].detach()
            else:
                s_lp = token_lp(student, ids, mask, width)
                adv = -(s_lp.detach() - t_lp) * m
                if arm == "k1-centred":
                    adv = (adv - adv.sum() / m.sum()) * m
                elif arm == "k1-clip":
                    adv = adv.clamp(min=-args.clip) * m
                elif arm == "k1-clip-centred":
                    adv = adv.clamp(-args.clip, args.clip) * m
                    adv = (adv - adv.sum() / m.sum()) * m
                elif arm == "prob":  # bounded: teacher prob - student prob of the token
                    adv = (t_lp.exp() - s_lp.detach().exp()) * m
                loss = -(adv * s_lp * m).sum() / m.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.actor.grad_clip)
            opt.step()
            if u % args.every == 0:
                diff = (s_lp.detach() - t_lp) * m
                kl = {}
                for name in teachers:
                    sel = torch.tensor([r[d.teacher_key] == name for r in rows])
                    kl[name] = round(float(diff[sel].sum() / m[sel].sum().clamp(min=1)), 2)
                garbage = float(((t_lp < -16) & (m > 0)).sum() / m.sum())
                print(
                    f"update {u}: reverse KL {kl}, garbage {garbage:.2f}, val {evaluate(student)}, "
                    f"loadavg {loadavg()}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
