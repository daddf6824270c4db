"""A transformers trainer for the real-vLLM tests (spawned; needs transformers)."""

import torch

from weightbus import ModuleSource
from weightbus.worker import WeightbusWorker


class HFTrainer(WeightbusWorker):
    def __init__(self, rank, world, path):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2)
        self.extra = None

    def train_step(self, step):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, self.model.config.vocab_size, (4, 24), generator=g)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def greedy(self, prompts, n):
        """What a transformers model holding these weights generates, greedily."""
        self.model.eval()
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                for _ in range(n):
                    nxt = self.model(input_ids=ids).logits[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
                out.append(ids[0, len(p):].tolist())
        self.model.train()
        return out

    def add_bogus(self, on):
        self.extra = {"model.bogus.weight": torch.ones(4, 4)} if on else None

    def weights_source(self):
        sd = dict(self.model.state_dict())
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)  # tied to the embedding: vLLM has no separate copy
        if self.extra:
            sd.update(self.extra)
        return ModuleSource(sd)
