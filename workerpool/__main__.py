from workerpool.cli import main

main()
