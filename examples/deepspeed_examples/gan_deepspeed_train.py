# DeepSpeedExamples' training/gan/gan_deepspeed_train.py, shrunk to run in seconds on a CPU, and
# ported to tiered by one line: `import deepspeed` became `import tiered.deepspeed as deepspeed`,
# and `get_accelerator` is imported from tiered.deepspeed.accelerator (docs/deepspeed.md lists the
# lines). The shrink, the same in the original: synthetic images instead of torchvision's data
# sets, no tensorboard writer or saved sample images, the device from get_accelerator() (the
# original sets CUDA device local_rank), and `--losses-out` (what
# tests/test_deepspeed_examples.py compares with plain PyTorch).
"""Train DCGAN with two DeepSpeed engines and the script's own Adam optimizers."""

import json
from time import time

import torch
import torch.nn as nn
import torch.utils.data
from gan_model import Discriminator, Generator, weights_init
from utils import create_folder, get_argument_parser, set_seed

import tiered.deepspeed as deepspeed
from tiered.deepspeed.accelerator import get_accelerator


def get_dataset(args):
    if args.dataroot is None and str(args.dataset).lower() != "fake":
        raise ValueError(f'`dataroot` parameter is required for dataset "{args.dataset}"')
    if args.dataset != "fake":
        raise ValueError("the shrunk example has only the fake data set")
    gen = torch.Generator().manual_seed(1234)  # torchvision's FakeData is seeded per image too
    images = torch.rand(args.num_images, 3, args.imageSize, args.imageSize, generator=gen) * 2 - 1
    labels = torch.zeros(args.num_images, dtype=torch.long)
    return torch.utils.data.TensorDataset(images, labels), 3


def train(args):
    create_folder(args.outf)
    set_seed(args.manualSeed)
    dataset, nc = get_dataset(args)
    dataloader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batchSize, shuffle=True, num_workers=int(args.workers)
    )
    device = torch.device(get_accelerator().device_name())
    ngpu = 0
    nz = int(args.nz)
    ngf = int(args.ngf)
    ndf = int(args.ndf)

    netG = Generator(ngpu, ngf, nc, nz).to(device)
    netG.apply(weights_init)
    if args.netG != "":
        netG.load_state_dict(torch.load(args.netG))

    netD = Discriminator(ngpu, ndf, nc).to(device)
    netD.apply(weights_init)
    if args.netD != "":
        netD.load_state_dict(torch.load(args.netD))

    criterion = nn.BCELoss()

    fixed_noise = torch.randn(args.batchSize, nz, 1, 1, device=device)
    real_label = 1
    fake_label = 0

    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))

    model_engineD, optimizerD, _, _ = deepspeed.initialize(
        args=args, model=netD, model_parameters=netD.parameters(), optimizer=optimizerD
    )
    model_engineG, optimizerG, _, _ = deepspeed.initialize(
        args=args, model=netG, model_parameters=netG.parameters(), optimizer=optimizerG
    )

    losses = []
    start = time()
    for epoch in range(args.epochs):
        for i, data in enumerate(dataloader, 0):
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, dtype=real.dtype, device=device)
            output = netD(real)
            errD_real = criterion(output, label)
            model_engineD.backward(errD_real)
            D_x = output.mean().item()

            noise = torch.randn(batch_size, nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            model_engineD.backward(errD_fake)
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            model_engineD.step()

            # (2) Update G: maximize log(D(G(z))); its backward reaches netD's parameters too,
            # which the next netD.zero_grad() drops
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)
            model_engineG.backward(errG)
            D_G_z2 = output.mean().item()
            model_engineG.step()

            print(
                "[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"  # noqa: UP031 - as the original logs
                % (epoch, args.epochs, i, len(dataloader), errD.item(), errG.item(), D_x, D_G_z1, D_G_z2)
            )
            losses.append([errD.item(), errG.item()])
            if i % 100 == 0:
                fake = netG(fixed_noise)  # the original saves these samples as images
    stop = time()
    print(f"total wall clock time for {args.epochs} epochs is {stop - start} secs")
    if args.losses_out:
        with open(args.losses_out, "w") as fh:
            json.dump(losses, fh)


def main():
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    train(args)


if __name__ == "__main__":
    main()
