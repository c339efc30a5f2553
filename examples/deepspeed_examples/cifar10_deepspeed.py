# DeepSpeedExamples' training/cifar/cifar10_deepspeed.py, shrunk to run in seconds on a CPU, and
# ported to tiered by its imports only: `import deepspeed` became `import tiered.deepspeed as
# deepspeed`, and the two `from deepspeed.X import Y` lines read `from tiered.deepspeed.X import Y`
# (docs/deepspeed.md lists these lines). The shrink, the same in the original: synthetic
# CIFAR-shaped images instead of the torchvision download, `--seed` and `--losses-out` (what
# tests/test_deepspeed_examples.py compares), and a data-set size flag.
"""Train a small CNN on CIFAR-shaped data with DeepSpeed (ZeRO stage from --stage)."""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import tiered.deepspeed as deepspeed
from tiered.deepspeed.accelerator import get_accelerator
from tiered.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=1, type=int, help="number of passes over the data")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed by a launcher")
    parser.add_argument("--log-interval", type=int, default=2, help="print the mean loss every N batches")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=3, type=int, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--moe", default=False, action="store_true", help="use DeepSpeed's MoE layer")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="(moe) experts per layer")
    parser.add_argument("--mlp-type", type=str, default="standard", help="(moe) standard or residual")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 or 2")
    parser.add_argument("--min-capacity", default=0, type=int, help="(moe) minimum expert capacity")
    parser.add_argument("--noisy-gate-policy", default=None, type=str, help="(moe) None, RSample or Jitter")
    parser.add_argument(
        "--moe-param-group", default=False, action="store_true", help="(moe) MoE param groups"
    )
    # the shrink: synthetic data of this many images, a seed, and the per-step losses as JSON
    parser.add_argument("--num-images", default=128, type=int)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--losses-out", default=None, type=str)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def create_moe_param_groups(model):
    """One group per kind of parameter: DeepSpeed needs the experts' apart under ZeRO."""
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args):
    """The example's DeepSpeed configuration, built from the command line."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


class SyntheticCIFAR10(torch.utils.data.Dataset):
    """CIFAR-10's shapes (3x32x32 images in [-1, 1], ten classes), drawn from a fixed seed."""

    def __init__(self, n, seed):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 3, 32, 32, generator=gen) * 2 - 1
        self.labels = torch.randint(0, 10, (n,), generator=gen)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


class Net(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = nn.ModuleList(
                deepspeed.moe.layer.MoE(
                    hidden_size=84,
                    expert=fc3,
                    num_experts=n_e,
                    ep_size=args.ep_world_size,
                    use_residual=args.mlp_type == "residual",
                    k=args.top_k,
                    min_capacity=args.min_capacity,
                    noisy_gate_policy=args.noisy_gate_policy,
                )
                for n_e in args.num_experts
            )
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            return self.fc4(x)
        return self.fc3(x)


def test(model_engine, testset, local_device, target_dtype, test_batch_size=4):
    """Accuracy of the trained network on held-out data."""
    testloader = torch.utils.data.DataLoader(testset, batch_size=test_batch_size, shuffle=False)
    correct, total = 0, 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
    if model_engine.local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total: .0f} %")


def main(args):
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    if torch.distributed.get_rank() != 0:
        torch.distributed.barrier()  # rank 0 prepares the data first (the original downloads it)
    trainset = SyntheticCIFAR10(args.num_images, seed=args.seed + 1)
    testset = SyntheticCIFAR10(16, seed=args.seed + 2)
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()

    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)

    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank

    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            losses.append(loss.item())
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1: d}, {i + 1: 5d}] loss: {running_loss / args.log_interval: .3f}")
                running_loss = 0.0
    print("Finished Training")
    test(model_engine, testset, local_device, target_dtype)
    if args.losses_out:
        with open(args.losses_out, "w") as fh:
            json.dump(losses, fh)


if __name__ == "__main__":
    args = add_argument()
    main(args)
