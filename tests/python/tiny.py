"""A tiny model for tests: its forward pass changes a buffer (BatchNorm
running statistics), and it has tied weights and dropout (draws RNG)."""
import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x).mean(1)
        h = self.drop(torch.relu(self.bn(self.fc(h))))
        return self.head(h)


def make(seed=0, lr=1e-2, dim=16):
    torch.manual_seed(seed)
    model = TinyNet(dim=dim)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    return model, opt, sched


def train_step(model, opt, sched, step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 32, (8, 4), generator=g)
    y = torch.randint(0, 32, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def state_bytes(model, opt):
    """Every tensor of model and optimizer, as bytes, by name."""
    out = {}
    for k, v in model.state_dict().items():
        out["m/" + k] = v.detach().contiguous().view(torch.uint8).numpy().tobytes() if v.dim() else v.numpy().tobytes()
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"o/{pid}/{k}"] = v.numpy().tobytes()
    return out
