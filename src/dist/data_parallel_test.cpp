#include "remat/data_parallel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "remat/error.h"
#include "remat/model.h"
#include "test_util.h"

namespace remat {
namespace {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(fd);
  return ntohs(a.sin_port);
}

// A second backward before wait() would sum into buckets whose all-reduce may be running: the
// first gradient past a step's backward passes is refused.
TEST(DataParallel, BucketsRefuseMoreBackwardPassesThanAStepHas) {
  const ModelConfig c = testing::tiny("gpt2");
  GPT model(c, Policy::parse("none"));
  DistConfig d;
  d.master_port = free_port();
  Communicator comm(d);
  GradientBuckets buckets(model->compiled_step(), model->parameters(), /*bucket_bytes=*/1, /*micro=*/1, comm);
  model->set_grad_sink(buckets.sink());
  auto [input, target] = random_batch(c);
  model->forward(input, target).backward();
  const std::string e = testing::error_of([&] { model->forward(input, target).backward(); });
  EXPECT_NE(e.find("got more gradients than the 1 backward pass(es) of a step"), std::string::npos) << e;
}

// A group of one: the buckets' layout and bookkeeping, without a second process.
TEST(DataParallel, BucketsFollowTheBackwardAndTiedWeightsAreReducedOnce) {
  const ModelConfig c = testing::tiny("gpt2");
  GPT model(c, Policy::parse("none"));
  DistConfig d;
  d.master_port = free_port();
  Communicator comm(d);
  const std::vector<at::Tensor> params = model->parameters();
  GradientBuckets buckets(model->compiled_step(), params, /*bucket_bytes=*/1, /*micro=*/1, comm);
  const CompiledStep& plan = model->compiled_step();
  EXPECT_EQ(buckets.buckets(), static_cast<int>(plan.stages.size()));  // 1 byte: a bucket per stage
  // The head's own parameters come first, the stem's (with the tied wte) last.
  for (int id : plan.stages.back().params) {
    if (plan.params[id].uses == 1) {
      EXPECT_EQ(buckets.bucket_of(id), 0) << plan.params[id].name;
    }
  }
  int wte = -1;
  for (size_t i = 0; i < plan.params.size(); ++i)
    if (plan.params[i].uses == 2) wte = static_cast<int>(i);
  ASSERT_GE(wte, 0);
  EXPECT_EQ(buckets.bucket_of(wte), buckets.buckets() - 1);
  int64_t numel = 0;
  for (const at::Tensor& p : params) numel += p.numel();
  EXPECT_EQ(buckets.bytes(), numel * 4);  // every gradient once
  // A step: the engine hands the gradients over; they are summed (a group of one: themselves).
  model->set_grad_sink(buckets.sink());
  auto [input, target] = random_batch(c);
  model->forward(input, target).backward();
  buckets.wait();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_FALSE(params[i].grad().defined()) << "autograd saw parameter " << i;
  GPT twin(c, Policy::parse("none"));
  {
    at::NoGradGuard off;
    for (size_t i = 0; i < params.size(); ++i) twin->parameters()[i].copy_(params[i]);
  }
  twin->forward(input, target).backward();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(testing::bitwise_equal(buckets.grad(static_cast<int>(i)), twin->parameters()[i].grad())) << i;
}

// A rank past the world and a port past 65535 are refused by name; a config inside both is not.
TEST(DataParallel, AConfigOutsideItsRangesIsRefused) {
  DistConfig d;
  d.world = 2;
  d.rank = 2;
  EXPECT_NE(testing::error_of([&] { validate(d); }).find("DistConfig.rank 2 must be in [0, 2)"), std::string::npos);
  d.rank = 1;
  d.master_port = 70000;
  EXPECT_NE(testing::error_of([&] { validate(d); }).find("DistConfig.master_port must be in 1..65535, got 70000"),
            std::string::npos);
  d.master_port = 29500;
  EXPECT_EQ(testing::error_of([&] { validate(d); }), "");
}

// torchrun's variables: read as given, and a value that is not an integer in range is refused with
// the variable's name (RANK must lie in the WORLD_SIZE read before it).
TEST(DataParallel, TheEnvironmentIsReadAndChecked) {
  const char* names[] = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
  std::vector<std::optional<std::string>> saved;
  for (const char* n : names)
    saved.push_back(std::getenv(n) ? std::optional<std::string>(std::getenv(n)) : std::nullopt);
  setenv("WORLD_SIZE", "4", 1), setenv("RANK", "3", 1), unsetenv("LOCAL_RANK");
  setenv("MASTER_ADDR", "10.0.0.1", 1), setenv("MASTER_PORT", "29600", 1);
  const DistConfig d = dist_config_from_env();
  EXPECT_EQ(d.world, 4);
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.local_rank, 3) << "LOCAL_RANK defaults to RANK";
  EXPECT_EQ(d.master_addr, "10.0.0.1");
  EXPECT_EQ(d.master_port, 29600);
  setenv("RANK", "4", 1);
  EXPECT_NE(testing::error_of([] { dist_config_from_env(); }).find("RANK='4' must be an integer in [0, 3]"),
            std::string::npos);
  setenv("RANK", "0", 1), setenv("MASTER_PORT", "80x", 1);
  EXPECT_NE(testing::error_of([] { dist_config_from_env(); }).find("MASTER_PORT='80x' must be an integer"),
            std::string::npos);
  for (size_t i = 0; i < saved.size(); ++i) saved[i] ? setenv(names[i], saved[i]->c_str(), 1) : unsetenv(names[i]);
}

}  // namespace
}  // namespace remat
