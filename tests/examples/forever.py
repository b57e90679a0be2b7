from torch import nn

model = nn.Linear(8, 8).cuda()
while True:
    pass
